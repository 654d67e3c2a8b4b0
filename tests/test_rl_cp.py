"""Context parallelism inside the RL loop, on gloo, against single-process runs of the same rollouts.

The demo config (configs/demo.toml: its policy sizes, draft_row_stride 8, K = 3) at a small batch, two
RL steps of the co-trained arm, fp64 models, a task with graded rewards (so advantages are non-zero):

* cp = 2: the CP group's rank 0 generates with the single process's sampler, so the run equals the
  single-process run_arm step by step — the same rollouts (tokens compared exactly), then losses,
  grad norms and the parameters after both steps.
* dp = 2 x cp = 2, with PPO (2 epochs x 2 minibatches: log-prob recompute under CP) and a KL penalty
  (reference log-probs under CP): every rank records its DP group's rollouts; one process then replays
  the union of them with `train_on_rollouts` (the single-process step on the same rollouts) and must
  give the same per-step losses, grad norms, PPO ratio statistics and final parameters.

Tolerance: fp64, rtol 1e-9 / atol 1e-12 (parameters 1e-10 absolute after two AdamW steps): the only
differences are summation orders (ring merges, per-rank partial sums of losses, counts and gradients).
A wrong shift, mask, border or count gives O(1e-3) or worse. policy/loss and the ratio / KL statistics are compared
at 1e-6 relative, like test_ttt's micro-batch test, a bound from when token_logprobs computed in fp32 for every
model (it now keeps fp64 logits in fp64: fp32 at least) (seen: 3e-8).
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specco.config_load import load_config
from specco.parallel.mesh import Mesh, spawn_local

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"

pytestmark = pytest.mark.dist


def _models():
    from specco.runner.warmstart import new_draft
    from specco.train.sft import tiny_policy_config
    from specco.data.tokenizer import build_char_tokenizer
    from specco.model.policy import Policy
    cfg = load_config(DEMO, [])
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    p = cfg.policy
    policy = Policy(tiny_policy_config(tok, p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads,
                                       p.intermediate_size)).double()
    torch.manual_seed(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8))).double()
    return tok, policy, draft


def union_rollouts(parts):
    """One Rollouts of the data-parallel ranks' rollouts `parts` (in rank order): what the single process trains on
    in the DP equivalence tests."""
    from specco.runner.rollouts import Rollouts
    return Rollouts([p for x in parts for p in x.pairs], parts[0].group_size,
                    torch.cat([x.advantages for x in parts]), [lp for x in parts for lp in x.engine_logprobs])


def _cfg(tmp, *extra):
    return load_config(DEMO, ["train.steps=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
                                             "rollout.k=2", "train.lr=3e-3", "train.draft_warmup_steps=0",
                                             f"out_dir={tmp}", *extra])


def _close(a, b, key, rtol=1e-9):
    assert abs(a - b) <= rtol * max(1.0, abs(b)), (key, a, b)


def _flat(st):
    return torch.cat([p.detach().flatten() for m in (st.policy, st.draft) for p in m.parameters()])


def _cp2_worker(rank, world, tmp):
    from test_grpo import DigitTask
    from specco.runner.rl import run_arm
    tmp = Path(tmp)
    tok, policy, draft = _models()
    cfg = _cfg(tmp, "rollout.prompts_per_step=4")
    ref_state, ref_rec = {}, []
    ref = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / f"ref{rank}", progress=False,
                  state_out=ref_state, record=ref_rec)
    mesh = Mesh.build(1, 2)
    st, rec = {}, []
    rows = run_arm(_cfg(tmp, "rollout.prompts_per_step=4", "parallel.cp=2"), "cotrained", policy, draft, DigitTask(),
                   tok, tmp / "cp", progress=False, mesh=mesh, state_out=st, record=rec)
    for a, b in zip(rec, ref_rec):  # the same rollouts, on both CP ranks
        assert a.pairs == b.pairs
    for r, q in zip(rows, ref):
        _close(r["policy/loss"], q["policy/loss"], "policy/loss", 1e-6)
        for k in ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/sim_accept_len", "draft/tokens"):
            _close(r[k], q[k], k)
        assert r["reward"] == q["reward"] and r["tau"] == q["tau"]
    torch.testing.assert_close(_flat(st["state"]), _flat(ref_state["state"]), rtol=1e-9, atol=1e-10)


@pytest.mark.slow
def test_rl_loop_cp2_equals_single_process(tmp_path):
    spawn_local(_cp2_worker, 2, str(tmp_path))


def _dp2cp2_worker(rank, world, tmp):
    from test_grpo import DigitTask
    from specco.runner.derive import generate_config
    from specco.runner.rl import run_arm
    from specco.runner.trainer import make_arm, train_on_rollouts
    tmp = Path(tmp)
    tok, policy, draft = _models()
    extra = ("rollout.prompts_per_step=8", "train.ppo_epochs=2", "train.minibatches=2", "train.kl_coef=0.1")
    cfg = _cfg(tmp, "parallel.dp=2", "parallel.cp=2", *extra)
    mesh = Mesh.build(2, 2)
    st, rec = {}, []
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp / "dpcp", progress=False, mesh=mesh,
                   state_out=st, record=rec)
    groups = [None] * 2
    dist.all_gather_object(groups, rec, group=mesh.dp_group)  # every DP group's rollouts, in DP order
    if rank != 0:
        return
    # The single-process step on the same rollouts: the union of the DP groups' rows, in rank order.
    cfg1 = _cfg(tmp, *extra)
    ref = make_arm(cfg1, "cotrained", policy, draft, generate_config(cfg1, tok.eos_id, tok.pad_id))
    for step, r in enumerate(rows):
        ro = union_rollouts([g[step] for g in groups])
        q = train_on_rollouts(ref, cfg1, ro, tok.pad_id, "cpu")
        for k in ("policy/loss", "policy/ratio_mean", "policy/ratio_dev", "policy/kl"):  # fp32 log-probs
            _close(r[k], q[k], k, 1e-6)
        for k in ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/sim_accept_len", "draft/tokens",
                  "policy/clip_frac"):
            _close(r[k], q[k], k)
        assert r["ppo/updates"] == q["ppo/updates"] == 4 and q["policy/kl"] > 0 and q["policy/ratio_dev"] > 0
    torch.testing.assert_close(_flat(st["state"]), _flat(ref), rtol=1e-9, atol=1e-10)


@pytest.mark.slow
def test_rl_loop_dp2_cp2_equals_single_process_on_the_same_rollouts(tmp_path):
    spawn_local(_dp2cp2_worker, 4, str(tmp_path))


def _mesh_worker(rank, world):
    mesh = Mesh.build(dp=1, cp=2, pp=2)
    assert (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank) == (rank // 2, 0, rank % 2)
    ranks = dist.get_process_group_ranks
    assert ranks(mesh.cp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(mesh.pp_group) == ranks(mesh.tap_group) == [rank % 2, rank % 2 + 2]
    assert mesh.tap_group is not mesh.pp_group  # its own communicator, never the schedule's
    assert ranks(mesh.grad_group) == ranks(mesh.cp_group)  # dp x cp of this stage
    with pytest.raises(ValueError, match=r"2 × 2 × 2 × 1 = 8 but the job has 4 processes"):
        Mesh.build(dp=2, cp=2, pp=2)


@pytest.mark.slow
def test_named_mesh_groups_and_mismatched_sizes():
    spawn_local(_mesh_worker, 4)


def test_packed_rows_on_one_device_attend_within_sequences_or_are_refused():
    """Five sequences packed into one row on one device: with the packing-aware functions (cp = 1 layout)
    the step equals the padded-rows step (fp64: losses, every gradient); without them it is refused
    (causal SDPA over the row would attend across sequence borders — the issue's -0.1796 vs -0.1275)."""
    from specco.batch import TrainBatch, pack
    from specco.parallel.cp import shard_batch
    from specco.parallel.layout import ZigzagPack
    from specco.parallel.zigzag import ZigzagLayout
    from specco.train.cotrain import StepConfig, build_optimizer, cotrain_step
    from test_cp_cotrain import V, _models as small_models
    g = torch.Generator().manual_seed(2)
    lens = [9, 4, 13, 2, 7]
    S = max(lens)
    tokens = torch.randint(0, V, (5, S), generator=g)
    mask = torch.zeros(5, S, dtype=torch.float64)
    for b, L in enumerate(lens):
        mask[b, min(2, L - 1):L] = 1
    rows = TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(5, generator=g, dtype=torch.float64),
                      logp_old=-torch.rand(5, S, generator=g, dtype=torch.float64))
    cfg = StepConfig(ttt_passes=3, loss_chunk=4, draft_row_stride=1)

    def step(batch, **fns):
        policy, draft = small_models()
        m = cotrain_step(policy, draft, batch, build_optimizer(policy, draft, 1e-3, 1e-2), None, cfg, **fns)
        return m, [p.grad.clone() for mod in (policy, draft) for p in mod.parameters()]

    m_ref, g_ref = step(rows)
    packed = pack(rows, lens)
    layout = ZigzagLayout(packed.cu_seqlens, 1, 0)
    m, grads = step(shard_batch(packed, layout), layout=ZigzagPack(None, layout))
    _close(m["policy/loss"], m_ref["policy/loss"], "policy/loss", 1e-6)
    _close(m["draft/loss"], m_ref["draft/loss"], "draft/loss")
    for a, b in zip(grads, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="packed batch .5 sequences in a row. needs a packed layout"):
        step(packed)


def test_parallel_imports_no_train_or_runner():
    """docs/DESIGN.md §7: parallel/ is applied from outside; it never imports train/ or runner/."""
    import ast
    root = Path(__file__).resolve().parents[1] / "specco" / "parallel"
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                assert not mod.startswith(("..train", "..runner", "specco.train", "specco.runner")), (f.name, mod)


def _norm_worker(rank, world):
    """optimizer_step's policy_norm_group: a parameter group split over 2 ranks (as over pipeline stages)
    clips by the norm of the whole group — the same scaled gradients as one rank holding all of it."""
    from specco.train.cotrain import clip_grad_norm
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    full = [torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.float64)) for _ in range(4)]
    for p, gr in zip(full, grads):
        p.grad = gr.clone()
    ref = clip_grad_norm(full, 1.0)
    mine = [torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.float64)) for _ in range(2)]
    for p, gr in zip(mine, grads[2 * rank:2 * rank + 2]):
        p.grad = gr.clone()
    total = clip_grad_norm(mine, 1.0, norm_group=dist.group.WORLD)
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=0)
    assert ref > 1.0  # the clip is active
    for p, q in zip(mine, full[2 * rank:2 * rank + 2]):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.slow
def test_grad_clip_norm_over_the_ranks_holding_the_group():
    spawn_local(_norm_worker, 2)
