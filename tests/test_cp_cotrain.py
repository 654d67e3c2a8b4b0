"""A whole co-training step under context parallelism equals the single-process step (cp = 1).

Reference: `cotrain_step` on one process over a right-padded (B, S_max) batch — plain causal SDPA in the
policy, `ttt_attention` and `shift_left` in the draft. CP: the same sequences packed into one THD stream,
zigzag-sharded with `shard_batch`, the policy's attention core, `cp_shift` and `ring_ttt_attention`
passed in (`layout.ZigzagPack`), global token counts, gradients summed over the group by cotrain_step's
`grad_group`. Compared: policy loss and draft loss (sums of the ranks' contributions), draft metrics
(already global), the gradient of every policy and draft parameter after the CP sum, the grad norms,
and the parameters after the optimizer step. GQA policy, K = 3 TTT passes, a sequence shorter than 2·cp;
once (cp = 3) with the CP policy's layers activation-checkpointed.

Tolerance: fp64, rtol 1e-9 / atol 1e-12 — the only differences are summation orders (the ring merge,
per-rank partial sums of losses and gradients); a wrong shift, mask or count gives O(1e-2) or worse.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from specco.model.policy import Policy
from specco.parallel.cp import shard_batch
from specco.parallel.layout import ZigzagPack
from specco.parallel.mesh import spawn_local
from specco.parallel.zigzag import ZigzagLayout
from specco.train.activation_checkpointing import apply_activation_checkpointing
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from cp_reference import pack_rows
from cli_helpers import DEMO  # noqa: E402

LENS = (11, 3, 17)
V = 61
TOL = dict(rtol=1e-9, atol=1e-12)

pytestmark = pytest.mark.dist


def _models():
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                      num_kv_heads=2)
    policy = Policy(pc).double()
    draft = Eagle3Draft(DraftConfig.for_policy(pc, 40, aux_layer_ids=(0, 2, 3)))
    draft.set_vocab_maps(*build_vocab_maps(torch.rand(V), 40))
    with torch.no_grad():  # far-from-uniform draft attention so that errors would show
        for p in draft.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return policy, draft.double()


def _data():
    g = torch.Generator().manual_seed(1)
    S = max(LENS)
    tokens = torch.randint(0, V, (len(LENS), S), generator=g)
    mask = torch.zeros(len(LENS), S, dtype=torch.float64)
    for b, L in enumerate(LENS):
        mask[b, min(4, L - 1):L] = 1  # completion tokens; the prompt and the right padding are 0
    logp_old = -torch.rand(len(LENS), S, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(len(LENS), generator=g, dtype=torch.float64)
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=adv, logp_old=logp_old)


def _pack(batch):
    return pack_rows(batch, LENS)


def _step(policy, draft, batch, **kw):
    opt = build_optimizer(policy, draft, 1e-3, 1e-2)
    cfg = StepConfig(ttt_passes=3, loss_chunk=5, policy_grad_clip=1.0, draft_grad_clip=1.0, draft_row_stride=1)
    m = cotrain_step(policy, draft, batch, opt, None, cfg, **kw)
    grads = {f"{tag}.{n}": p.grad.clone() for tag, mod in (("policy", policy), ("draft", draft))
             for n, p in mod.named_parameters()}
    params = {f"{tag}.{n}": p.detach().clone() for tag, mod in (("policy", policy), ("draft", draft))
              for n, p in mod.named_parameters()}
    return m, grads, params


def _worker(rank, world, ckpt=False):
    batch = _data()
    m_ref, g_ref, p_ref = _step(*_models(), batch)

    group = dist.group.WORLD
    packed, cu = _pack(batch)
    lay = ZigzagLayout(cu, world, rank)
    local = shard_batch(packed, lay)
    policy, draft = _models()
    if ckpt:  # the ring runs again inside the backward's recompute: sends/receives must still pair up
        apply_activation_checkpointing(policy)
    m, g, p = _step(policy, draft, local, grad_group=group, layout=ZigzagPack(group, lay))

    for key in ("policy/loss", "draft/loss"):  # each rank holds its local contribution to the global mean
        total = torch.tensor([m[key]], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        assert abs(total.item() - m_ref[key]) <= 1e-9 * abs(m_ref[key]), (key, total.item(), m_ref[key])
    for key in m_ref:  # already global: counts, CE means, top-1 / acceptance stats, grad norms, lrs
        if key.startswith(("draft/", "policy/grad_norm", "draft/grad_norm")) and key != "draft/loss":
            assert abs(m[key] - m_ref[key]) <= 1e-9 * max(1.0, abs(m_ref[key])), (key, m[key], m_ref[key])
    assert m["draft/tokens"] == m_ref["draft/tokens"] > 0
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], **TOL, msg=lambda s: f"cp={world} grad {name}: {s}")
        torch.testing.assert_close(p[name], p_ref[name], **TOL, msg=lambda s: f"cp={world} param {name}: {s}")


@pytest.mark.slow
@pytest.mark.parametrize("cp,ckpt", [(2, False), (4, False), (3, True)])
def test_cotrain_step_cp_equals_single_process(cp, ckpt):
    spawn_local(_worker, cp, ckpt)


def test_shift_refactor_keeps_single_process_policy_loss():
    """cotrain_step's policy loss now aligns next tokens through `shift`; with shift_left it must equal
    the explicit logits[:, :-1] vs tokens[:, 1:] formula."""
    from specco.train.losses import clipped_surrogate, token_logprobs
    batch = _data()
    policy, draft = _models()
    m, _, _ = _step(policy, draft, batch)
    policy, _ = _models()
    with torch.no_grad():
        logits = policy(batch.tokens).logits
        lp = token_logprobs(logits[:, :-1], batch.tokens[:, 1:])
        # logp_old is indexed like the logits (batch.py): entry j-1 is token j's
        ref, _ = clipped_surrogate(lp, batch.logp_old[:, :-1], batch.advantages, batch.target_mask[:, 1:], 0.2)
    assert abs(m["policy/loss"] - ref.item()) <= 1e-12 * abs(ref.item())


def _launch_worker(rank, world):
    from specco.config_load import load_config
    from specco.runner.cotrain_cp import run_cotrain_step_cp
    from specco.parallel.mesh import Mesh
    cfg = load_config(DEMO, ["parallel.dp=2", "parallel.cp=2", "policy.hidden_size=32", "policy.num_layers=2", "draft.aux_layer_ids=[]",
                             "policy.intermediate_size=32", "draft.ttt_passes=2"])
    mesh = Mesh.build(2, 2)
    assert (mesh.dp_rank, mesh.cp_rank) == divmod(rank, 2)
    hist = run_cotrain_step_cp(cfg, steps=2, seq_lens=(40, 3), mesh=mesh, log=None)
    for m in hist:  # global metrics: identical on every rank, finite
        vals = torch.tensor([m["policy/loss"], m["draft/loss"], m["policy/grad_norm"], m["draft/grad_norm"]],
                            dtype=torch.float64)
        assert torch.isfinite(vals).all()
        ref = vals.clone()
        dist.broadcast(ref, 0)
        torch.testing.assert_close(vals, ref, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_launch_dp2_cp2_runs():
    spawn_local(_launch_worker, 4)
