"""Data parallelism of the co-training step, incl. micro-batching: 2 gloo ranks == one process.

Each rank holds half of the rows of a batch; `cotrain_step` with grad_group = WORLD, the global
policy-token count, micro-batches of 3 rows (uneven: 4 rows per rank) and draft row stride 2 must
give the single-process whole-batch step: losses (summed over ranks), the draft's metrics (global),
every gradient after the all-reduce, and the parameters after the optimizer step. fp64: rtol 1e-9
(summation order only).
"""
import pytest
import torch
import torch.distributed as dist

from specco.parallel.mesh import spawn_local
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from test_cp_cotrain import V, _models

B, S = 8, 14

pytestmark = pytest.mark.dist


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        mask[b, 3:S - b % 3] = 1
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=g, dtype=torch.float64),
                      logp_old=-torch.rand(B, S, generator=g, dtype=torch.float64) * 3)


def _run(batch, micro, **kw):
    policy, draft = _models()
    opt = build_optimizer(policy, draft, 1e-3, 1e-2)
    cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=2, micro_batch_rows=micro)
    m = cotrain_step(policy, draft, batch, opt, None, cfg, **kw)
    named = [(f"{t}.{n}", p) for t, mod in (("policy", policy), ("draft", draft)) for n, p in mod.named_parameters()]
    return m, {n: p.grad.clone() for n, p in named}, {n: p.detach().clone() for n, p in named}


def _worker(rank, world):
    full = _batch()
    m_ref, g_ref, p_ref = _run(full, 0)
    h = B // world
    take = lambda t: t[rank * h:(rank + 1) * h]  # noqa: E731
    local = TrainBatch(tokens=take(full.tokens), target_mask=take(full.target_mask),
                       advantages=take(full.advantages), logp_old=take(full.logp_old))
    m, g, p = _run(local, 3, grad_group=dist.group.WORLD)
    for key in ("policy/loss", "draft/loss"):
        total = torch.tensor([m[key]], dtype=torch.float64)
        dist.all_reduce(total)
        assert abs(total.item() - m_ref[key]) <= 1e-9 * abs(m_ref[key]), (key, total.item(), m_ref[key])
    for key in m_ref:  # the draft's metrics come from statistics summed over micro-batches and ranks
        if key.startswith("draft/") and key != "draft/loss":
            assert abs(m[key] - m_ref[key]) <= 1e-9 * max(1.0, abs(m_ref[key])), (key, m[key], m_ref[key])
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-9, atol=1e-12, msg=lambda s: f"grad {n}: {s}")
        torch.testing.assert_close(p[n], p_ref[n], rtol=1e-9, atol=1e-12, msg=lambda s: f"param {n}: {s}")


@pytest.mark.slow
def test_dp_microbatched_step_equals_single_process():
    spawn_local(_worker, 2)


def _rl_worker(rank, world, tmp):
    """The RL loop on 2 data-parallel ranks: a straight 4-step run, and 2 steps + resume + 2 steps."""
    from pathlib import Path

    from specco.parallel.mesh import Mesh
    from specco.runner.rl import run_arm
    from specco.runner.warmstart import new_draft
    import json

    from specco.train.checkpoint import latest_checkpoint
    from test_grpo import DigitTask, _cfg, _setup
    tmp = Path(tmp)
    tok, policy = _setup()  # seeded: the same weights on both ranks
    torch.manual_seed(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp, "train.steps=4", "parallel.dp=2", "rollout.prompts_per_step=4", "train.micro_batch_rows=5")
    mesh = Mesh.build(2, 1)
    run = lambda d, **kw: run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / d,  # noqa: E731
                                  progress=False, mesh=mesh, **kw)
    final_a, final_b = {}, {}
    straight = run("a", state_out=final_a)
    part1 = run("b", stop_after=2)
    part2 = run("b", state_out=final_b)
    assert [r["step"] for r in part1 + part2] == [1, 2, 3, 4]
    for a, b in zip(straight, part1 + part2):  # every rank sees the reduced metrics
        for k in ("reward", "policy/loss", "draft/loss", "tau", "policy/grad_norm"):
            assert a[k] == b[k], (rank, k, a[k], b[k])
    # each rank's own trained weights: identical across ranks (the same summed gradients) and equal to
    # the resumed run's
    for final in (final_a, final_b):
        st = final["state"]
        flat = torch.cat([p.detach().flatten().double() for m in (st.policy, st.draft) for p in m.parameters()])
        both = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(both, flat)
        assert torch.equal(both[0], both[1])
        final["flat"] = flat
    assert torch.equal(final_a["flat"], final_b["flat"])
    # a sharded checkpoint (runner/arm_checkpoint.py): every DP rank's own sampler state in its JSON manifest
    run = json.loads((latest_checkpoint(tmp / "b" / "ckpt") / "state.json").read_text())["extra"]["run"]
    assert len(run["samplers"]) == 2 and run["samplers"][0] != run["samplers"][1]
    if rank == 0:
        assert (tmp / "a" / "metrics.jsonl").read_text().count("\n") == 4


@pytest.mark.slow
def test_dp_rl_loop_resumes_bit_exactly_and_keeps_ranks_in_sync(tmp_path):
    spawn_local(_rl_worker, 2, str(tmp_path))


def _eval_worker(rank, world):
    """The frozen arm's draft metrics under DP (`measure.draft_eval` with count_group): the loss summed over
    ranks and every draft metric equal the single-process evaluation of the whole batch (fp64)."""
    from specco.runner.measure import draft_eval
    full = _batch()
    policy, draft = _models()
    cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=2)
    ref = draft_eval(policy, draft, full, cfg)
    h = B // world
    take = lambda t: t[rank * h:(rank + 1) * h]  # noqa: E731
    local = TrainBatch(tokens=take(full.tokens), target_mask=take(full.target_mask))
    m = draft_eval(policy, draft, local, cfg, count_group=dist.group.WORLD)
    total = torch.tensor([m["draft/loss"]], dtype=torch.float64)
    dist.all_reduce(total)
    assert abs(total.item() - ref["draft/loss"]) <= 1e-9 * abs(ref["draft/loss"])
    for key in ref:
        if key != "draft/loss":
            assert abs(m[key] - ref[key]) <= 1e-9 * max(1.0, abs(ref[key])), (key, m[key], ref[key])


@pytest.mark.slow
def test_dp_frozen_arm_draft_metrics_are_global():
    spawn_local(_eval_worker, 2)


def _window_worker(rank, world):
    """The frozen shadow's output-position windows under DP (`measure.draft_evals` with a window and count_group):
    two drafts, rank 1's completions shorter than rank 0's (it has fewer windows, filled with zero counts) and
    micro-batches of one row: every draft's per-window metrics equal the single-process evaluation (fp64). Catches
    ranks summing their windows in different orders."""
    import copy
    from specco.runner.measure import draft_evals
    full = _batch()
    full.target_mask[B // 2:, 8:] = 0  # rank 1's rows end at position 7: windows from 0 and 3 only
    policy, draft = _models()
    other = copy.deepcopy(draft)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drafts = {"a": draft, "b": other}
    cfg = StepConfig(ttt_passes=3, loss_chunk=5, draft_row_stride=1, micro_batch_rows=1)
    ref = draft_evals(policy, drafts, full, cfg, window=3)
    h = B // world
    take = lambda t: t[rank * h:(rank + 1) * h]  # noqa: E731
    local = TrainBatch(tokens=take(full.tokens), target_mask=take(full.target_mask))
    got = draft_evals(policy, drafts, local, cfg, count_group=dist.group.WORLD, window=3)
    assert "draft/sim_accept_len@9" in ref["a"]  # the longest rows (rank 0's) reach a fourth window
    for name in drafts:
        for key in ref[name]:
            if "@" in key:
                assert abs(got[name][key] - ref[name][key]) <= 1e-9 * max(1.0, abs(ref[name][key])), \
                    (name, key, got[name][key], ref[name][key])


def test_dp_shadow_windows_are_global():
    spawn_local(_window_worker, 2)
