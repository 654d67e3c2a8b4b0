"""Mixed precision (bf16 autocast) of the co-training step, on CPU.

Against the fp32 step on the same inputs: the policy and draft losses within 2% (bf16 has 8 mantissa
bits: ~0.4% per rounding, a few roundings deep), each parameter group's gradient direction within
cosine 0.99 and norm within 5%; gradients and weights stay fp32 (fp32 master weights). The step's
attention Functions get mixed-dtype q/k/v under autocast (RoPE's fp32 tables promote q and k) and
must cast them to one dtype themselves (`ops.attention.autocast_inputs`): the ring path (cp = 1) too.
"""
import functools

import pytest
import torch

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft
from specco.model.policy import Policy
from specco.parallel.layout import PaddedRows
from specco.parallel.ring_attention import ring_ttt_attention
from specco.parallel.zigzag import ZigzagLayout
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from cli_helpers import DEMO  # noqa: E402

V = 67


def _models():
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2)
    return Policy(pc), Eagle3Draft(DraftConfig.for_policy(pc, aux_layer_ids=(0, 1, 2)))


def _batch():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (4, 24), generator=g)
    mask = torch.zeros(4, 24)
    mask[:, 6:] = 1
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(4, generator=g),
                      logp_old=-torch.rand(4, 24, generator=g) * 4 - 2)


def _step(amp, attn=None):
    policy, draft = _models()
    opt = build_optimizer(policy, draft, 1e-3, 1e-3)
    kw = {} if attn is None else {"layout": PaddedRows(attn)}
    m = cotrain_step(policy, draft, _batch(), opt, None, StepConfig(ttt_passes=3, amp_dtype=amp, draft_row_stride=1), **kw)
    grads = {name: torch.cat([p.grad.flatten() for p in mod.parameters()]) for name, mod in
             (("policy", policy), ("draft", draft))}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for mod in (policy, draft) for p in mod.parameters())
    return m, grads


@pytest.mark.parametrize("attn", ["single", "ring_cp1"])
def test_bf16_autocast_step_tracks_fp32(attn):
    fn = None
    if attn == "ring_cp1":  # the CP attention path with one rank: no communication, same Functions
        fn = functools.partial(ring_ttt_attention, group=None, layout=ZigzagLayout((0, 24), 1, 0))
        # a padded batch is one sequence per row here; cp = 1 layouts need one packed row: use B rows as is
        fn = _per_row(fn)
    m32, g32 = _step(None, fn)
    m16, g16 = _step(torch.bfloat16, fn)
    for key in ("policy/loss", "draft/loss"):
        assert abs(m16[key] - m32[key]) <= 0.02 * abs(m32[key]) + 1e-3, (key, m16[key], m32[key])
    for name in g32:
        a, b = g16[name], g32[name]
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        assert cos > 0.99, (name, cos)
        assert abs(a.norm() / b.norm() - 1) < 0.05, name


def _per_row(fn):
    """ring_ttt_attention takes one packed row (B = 1): apply it to each row of a (B, ...) batch."""
    def attn(q, k, v, kb=None, vb=None, **kw):
        outs = [fn(q[i:i + 1], k[i:i + 1], v[i:i + 1], None if kb is None else kb[i:i + 1],
                   None if vb is None else vb[i:i + 1], **kw) for i in range(q.shape[0])]
        return torch.cat(outs, 0)
    return attn


def test_amp_dtype_is_validated():
    with pytest.raises(ValueError, match="amp_dtype"):
        StepConfig(amp_dtype=torch.float16)


def test_autocast_inputs_casts_to_one_dtype_and_disables_autocast():
    from specco.ops.attention import autocast_inputs
    q, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4).bfloat16()
    (q2, v2, none), ctx = autocast_inputs(q, v, None)
    assert q2 is q and v2 is v and none is None  # no autocast: untouched
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (q2, v2, none), ctx = autocast_inputs(q, v, None)
        assert q2.dtype == v2.dtype == torch.bfloat16 and none is None
        with ctx:
            assert not torch.is_autocast_enabled("cpu")


def _cp_amp_worker(rank, world, amp, out_path):
    from specco.config_load import load_config
    from specco.runner.cotrain_cp import run_cotrain_step_cp
    from specco.parallel.mesh import Mesh
    cfg = load_config(DEMO, [f"parallel.cp={world}", "policy.hidden_size=64", "policy.num_layers=2", "draft.aux_layer_ids=[]",
                             "policy.num_heads=4", "policy.num_kv_heads=2", "policy.intermediate_size=96",
                             "draft.ttt_passes=3", f"train.amp={amp}",
                             f"train.activation_checkpointing={'true' if amp == 'bf16' else 'false'}"])
    hist = run_cotrain_step_cp(cfg, steps=1, seq_lens=(64, 29, 3), mesh=Mesh.build(1, world), log=None)
    if rank == 0:
        import json
        with open(out_path, "w") as f:
            json.dump(hist[0], f)


@pytest.mark.dist
@pytest.mark.slow
def test_cp_bf16_checkpointed_step_tracks_single_process_fp32(tmp_path):
    """CP (cp = 2, gloo: bf16 K/V shards travel the ring) with bf16 autocast and activation
    checkpointing vs one process in fp32 without either, same synthetic pack: losses within 2%,
    grad norms within 5% (bf16 rounding; the fp64 CP tests pin the exact math)."""
    import json
    from specco.parallel.mesh import spawn_local
    spawn_local(_cp_amp_worker, 2, "bf16", str(tmp_path / "cp.json"))
    spawn_local(_cp_amp_worker, 1, "none", str(tmp_path / "ref.json"))
    cp, ref = (json.loads((tmp_path / f).read_text()) for f in ("cp.json", "ref.json"))
    for key in ("policy/loss", "draft/loss"):
        assert abs(cp[key] - ref[key]) <= 0.02 * abs(ref[key]) + 1e-3, (key, cp[key], ref[key])
    for key in ("policy/grad_norm", "draft/grad_norm"):
        assert abs(cp[key] / ref[key] - 1) < 0.05, (key, cp[key], ref[key])
