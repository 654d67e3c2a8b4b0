"""Block drafters (DFlash / DSpark) under context parallelism: one co-training step at cp = 2 and 4 equals the
single-process step (cp = 1), and a packed row on one device (cp = 1 through `BlockCP`) equals it too.

Reference: `cotrain_step` on one process over right-padded (B, S_max) rows — causal SDPA in the policy,
`block_attention` and `local_plan` in the draft. CP: the same sequences packed into one THD stream, zigzag-
sharded, with `layout.ZigzagPack` (ring policy attention, CP shift, `BlockCP`: per-sequence anchors from the gathered
content, each block on its anchor's rank, the trunk on the ring). Chunks are 1-5 tokens and blocks 3-4 slots,
so most blocks straddle zigzag chunk borders (asserted), and a sequence is shorter than 2·cp. Compared: both
losses (sums of the ranks' contributions), every global draft metric, every gradient of policy and draft and
the parameters after the step.

Tolerance: fp64, rtol 1e-9 / atol 1e-12 — differences are summation orders only (ring merges, per-rank partial
sums); a wrong anchor, shift, position mask or count gives O(1e-2) or worse.
"""
import pytest
import torch
import torch.distributed as dist

from specco.model.config import PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.policy import Policy
from specco.parallel.cp import shard_batch
from specco.parallel.layout import PaddedRows, ZigzagPack
from specco.parallel.mesh import spawn_local
from specco.parallel.zigzag import ZigzagLayout
from specco.train.block_losses import sample_anchors
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from cp_reference import pack_rows

LENS = (19, 3, 26)
V = 61
TOL = dict(rtol=1e-9, atol=1e-12)

pytestmark = pytest.mark.dist


def _models(kind):
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2)
    policy = Policy(pc).double()
    draft = BlockDraft(BlockDraftConfig.for_policy(pc, kind, gamma=3, mask_id=V - 1, num_layers=2, num_anchors=6,
                                                   markov_rank=4, aux_layer_ids=(0, 2, 3)))
    with torch.no_grad():  # far-from-uniform attention and a live Markov head, so that errors would show
        for p in draft.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
        if kind == "dspark":
            torch.nn.init.normal_(draft.markov_w2.weight, std=0.3)
    return policy, draft.double()


def _data():
    g = torch.Generator().manual_seed(1)
    S = max(LENS)
    tokens = torch.randint(0, V - 1, (len(LENS), S), generator=g)
    mask = torch.zeros(len(LENS), S, dtype=torch.float64)
    for b, L in enumerate(LENS):
        mask[b, min(4, L - 2):L] = 1  # completion tokens; the prompt and the right padding are 0
    mask[0, 12] = 0  # a hole: slot validity stops there (prefix-contiguous)
    logp_old = -torch.rand(len(LENS), S, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(len(LENS), generator=g, dtype=torch.float64)
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=adv, logp_old=logp_old)


def _pack(batch):
    return pack_rows(batch, LENS)


def _step(policy, draft, batch, **kw):
    opt = build_optimizer(policy, draft, 1e-3, 1e-2)
    cfg = StepConfig(loss_chunk=5, policy_grad_clip=1.0, draft_grad_clip=1.0, draft_row_stride=1)
    m = cotrain_step(policy, draft, batch, opt, None, cfg, **kw)
    mods = (("policy", policy), ("draft", draft))
    grads = {f"{t}.{n}": p.grad.clone() for t, mod in mods for n, p in mod.named_parameters() if p.grad is not None}
    params = {f"{t}.{n}": p.detach().clone() for t, mod in mods for n, p in mod.named_parameters()}
    return m, grads, params


def _compare(m, g, p, ref, world, sum_losses):
    m_ref, g_ref, p_ref = ref
    for key in ("policy/loss", "draft/loss"):  # each rank holds its contribution to the global mean
        total = torch.tensor([m[key]], dtype=torch.float64)
        if sum_losses:
            dist.all_reduce(total)
        assert abs(total.item() - m_ref[key]) <= 1e-9 * abs(m_ref[key]), (key, total.item(), m_ref[key])
    keys = [k for k in m_ref if k.startswith(("draft/", "policy/grad_norm")) and k != "draft/loss"]
    assert "draft/tau_prob" in keys and "draft/conf_err" in keys
    for key in keys:  # already global
        assert abs(m[key] - m_ref[key]) <= 1e-9 * max(1.0, abs(m_ref[key])), (world, key, m[key], m_ref[key])
    assert m["draft/tokens"] == m_ref["draft/tokens"] > 0
    assert g.keys() == g_ref.keys() and any(k.startswith("draft.layers.0.self_attn") for k in g)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], **TOL, msg=lambda s: f"cp={world} grad {name}: {s}")
        torch.testing.assert_close(p[name], p_ref[name], **TOL, msg=lambda s: f"cp={world} param {name}: {s}")


def _crossing_blocks(packed, cu, cp, num_anchors, gamma):
    """How many blocks (anchor, label positions p..p+γ) span more than one zigzag chunk."""
    n = 0
    for (a, b), c in zip(zip(cu, cu[1:]), ZigzagLayout(cu, cp, 0).chunks):
        anc, _ = sample_anchors(packed.tokens[:, a:b], packed.target_mask[:, a:b], num_anchors)
        n += int(((anc // c) != ((anc + gamma).clamp_max(b - a - 1) // c)).sum())
    return n


def _worker(rank, world, kind):
    batch = _data()
    ref = _step(*_models(kind), batch)
    packed, cu = _pack(batch)
    if rank == 0:
        assert _crossing_blocks(packed, cu, world, 6, 3) >= 6
    lay = ZigzagLayout(cu, world, rank)
    m, g, p = _step(*_models(kind), shard_batch(packed, lay), grad_group=dist.group.WORLD,
                    layout=ZigzagPack(dist.group.WORLD, lay))
    _compare(m, g, p, ref, world, sum_losses=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("cp", [2, 4])
def test_block_cotrain_step_cp_equals_single_process(kind, cp):
    spawn_local(_worker, cp, kind)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_cotrain_packed_row_equals_padded_rows(kind):
    """cp = 1 on one device: a packed row through BlockCP (per-sequence anchors and trunk) == right-padded rows."""
    batch = _data()
    ref = _step(*_models(kind), batch)
    packed, cu = _pack(batch)
    lay = ZigzagLayout(cu, 1, 0)
    m, g, p = _step(*_models(kind), shard_batch(packed, lay), layout=ZigzagPack(None, lay))
    _compare(m, g, p, ref, 1, sum_losses=False)


def test_block_drafter_on_packed_rows_without_plan_is_refused():
    packed, cu = _pack(_data())
    lay = ZigzagLayout(cu, 1, 0)
    with pytest.raises(ValueError, match="needs a packed layout"):
        _step(*_models("dflash"), shard_batch(packed, lay), layout=PaddedRows())
    no_plan = ZigzagPack(None, lay)
    no_plan.block = None  # a packed layout without its block plan: the drafter kind refuses it by name
    with pytest.raises(ValueError, match="needs a layout with a block plan"):
        _step(*_models("dflash"), shard_batch(packed, lay), layout=no_plan)
