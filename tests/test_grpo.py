"""GRPO pieces against hand-computed cases, a short RL run that learns, resume bit-exactness,
and the three arms' rollouts being identically distributed."""
import math
from dataclasses import dataclass

import pytest
import torch

from specco.config_load import load_config
from specco.data.tokenizer import build_char_tokenizer
from specco.model.policy import Policy
from specco.runner.rl import run_arm
from specco.runner.warmstart import new_draft
from resume_helpers import assert_same_final_weights
from specco.train.losses import clipped_surrogate, grpo_advantages
from specco.data.source import Example
from specco.rewards.core import RewardBatch
from specco.train.sft import tiny_policy_config
from cli_helpers import DEMO  # noqa: E402

pytestmark = pytest.mark.e2e


def test_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = grpo_advantages(r, 4)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expect = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0, 0, 0, 0]
    assert torch.allclose(a, torch.tensor(expect), atol=1e-5)
    assert torch.allclose(grpo_advantages(r, 4, scale_by_std=False)[:4], torch.tensor([.5, -.5, -.5, .5]))
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(r, 3)


def test_clipped_surrogate_hand_computed():
    # ratios e^0.5=1.6487 (clipped to 1.2 for A>0), e^-0.5=0.6065 (A<0: min picks clip 0.8*A)
    lp_old = torch.zeros(1, 4)
    lp_new = torch.tensor([[0.5, -0.5, 0.1, 0.0]])
    adv = torch.tensor([[1.0, -1.0, -2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = clipped_surrogate(lp_new, lp_old, adv, mask, clip_eps=0.2)
    m = stats.metrics()
    r3 = math.exp(0.1)
    expect = -(1.2 * 1 + min(math.exp(-0.5) * -1, 0.8 * -1) + min(r3 * -2, min(r3, 1.2) * -2)) / 3
    assert abs(loss.item() - expect) < 1e-6
    assert abs(m["policy/clip_frac"] - 2 / 3) < 1e-6
    # k3 KL term: exp(d) - d - 1 with d = ref - new
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    loss_kl, _ = clipped_surrogate(lp_new, lp_old, adv, mask, 0.2, ref, kl_coef=0.5)
    kl = sum(math.exp(-x) + x - 1 for x in (0.5, -0.5, 0.1)) / 3
    assert abs(loss_kl.item() - (expect + 0.5 * kl)) < 1e-6


class DigitTask:
    """An easy job for a from-scratch policy: prompts 'a' / 'b', reward = fraction of digits in the completion.
    It has a job's data shape (runner.validate.JobData): `train` (a PromptSource: itself) and `rewards`."""
    name, num_rows, eval, sft = "digits", None, None, None

    def __init__(self):
        self.tok = build_char_tokenizer()
        self.train = self

    def examples(self, n, seed, offset=0):
        prompts = ["ab"[(offset + i) % 2] for i in range(n)]
        return [Example(offset + i, p, self.tok.encode(p, add_bos=True), {}, None) for i, p in enumerate(prompts)]

    def score(self, text, item):
        return sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0

    def rewards(self, prompts, completions, completion_ids, columns):
        r = torch.tensor([self.score(t, p) for t, p in zip(completions, prompts)], dtype=torch.float32)
        return RewardBatch(rewards=r, valid=torch.ones(len(r), dtype=torch.bool), metrics={}, full_marks=r >= 1)


def _setup(seed=0):
    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    pc = tiny_policy_config(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                            intermediate_size=64)
    return tok, Policy(pc)


def _cfg(tmp_path, *extra):
    return load_config(DEMO, ["train.lr=3e-3", "rollout.max_new_tokens=6", "rollout.group_size=4",
                              "rollout.prompts_per_step=4", "rollout.k=2", "train.checkpoint_every=2",
                              "draft.ttt_passes=2", f"out_dir={tmp_path}", *extra])


@pytest.mark.slow
def test_short_rl_run_raises_reward(tmp_path):
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=30", "rollout.group_size=8", "train.lr=1e-2")
    rows = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "none", progress=False)
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)


def test_resume_is_bit_exact(tmp_path):
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp_path, "train.steps=4")
    straight = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "a", progress=False)
    part1 = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "b", progress=False,
                    stop_after=2)
    part2 = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "b", progress=False)
    assert len(part1) == 2 and len(part2) == 2
    for a, b in zip(straight, part1 + part2):
        for k in ("reward", "policy/loss", "draft/loss", "tau"):
            assert a[k] == b[k], (k, a[k], b[k])
    sa, sb = assert_same_final_weights(tmp_path / "a", tmp_path / "b")
    # the resumed run's log holds every step once, in order (a crash after the step-2 checkpoint and
    # before more logging must not lose or duplicate a row)
    from specco.runner.report import read_jsonl
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["reward"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [r["reward"] for r in straight]
    # each param group keeps its own LR through the resume
    lrs = [g["lr"] for g in sb["opt"]["param_groups"]]
    assert lrs[0] != lrs[1] and lrs == [g["lr"] for g in sa["opt"]["param_groups"]]


def test_activation_checkpointing_leaves_the_rl_loop_unchanged(tmp_path):
    """`train.activation_checkpointing=true` only recomputes: the same 3 co-training steps (fp32) give the
    same rewards, losses and τ (1e-6: the recompute is the same arithmetic)."""
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    rows = {}
    for flag in ("false", "true"):
        cfg = _cfg(tmp_path, "train.steps=3", f"train.activation_checkpointing={flag}")
        rows[flag] = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / flag, progress=False)
    for a, b in zip(rows["false"], rows["true"]):
        for k in ("reward", "policy/loss", "draft/loss", "tau", "policy/grad_norm", "draft/grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])), (k, a[k], b[k])


def test_bf16_rl_loop_starts_each_step_at_ratio_one(tmp_path):
    """`train.amp=bf16` on CPU, the whole loop: two co-training steps run, nothing is clipped at the
    step's start, metrics stay finite. (The ratio-is-exactly-1 property: the next test.)"""
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp_path, "train.steps=2", "train.amp=bf16")
    rows = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / "amp", progress=False)
    assert len(rows) == 2
    for r in rows:
        assert r["policy/clip_frac"] == 0.0
        assert all(math.isfinite(r[k]) for k in ("policy/loss", "draft/loss", "policy/grad_norm", "reward"))


def test_bf16_recompute_matches_the_step_so_the_ratio_starts_at_one():
    """logp_old from `recompute_logprobs` under the step's autocast equals the step's own log-probs
    before the update, so the surrogate is exactly -sum(A·mask)/sum(mask); an fp32 recompute differs
    from the bf16 one by bf16 rounding (which would put the ratio off 1 by ~1e-2)."""
    from specco.runner.rollouts import recompute_logprobs
    from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
    tok, policy = _setup()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, tok.vocab_size, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[:, 4:] = 1
    adv = torch.randn(4, generator=g)
    amp, fp32 = StepConfig(amp_dtype=torch.bfloat16), StepConfig()
    lp_amp, lp_32 = recompute_logprobs(policy, tokens, amp), recompute_logprobs(policy, tokens, fp32)
    assert (lp_amp - lp_32).abs().max() > 1e-4  # the recompute really ran under autocast
    batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=adv, logp_old=lp_amp)
    m = cotrain_step(policy, None, batch, build_optimizer(policy, None, 1e-3, 1e-3), None,
                     StepConfig(draft_weight=0.0, amp_dtype=torch.bfloat16))
    m_tok = mask[:, 1:]  # token j is predicted at j-1: the shifted mask the loss uses
    expect = -(adv[:, None] * m_tok).sum() / m_tok.sum()
    assert m["policy/clip_frac"] == 0.0
    assert abs(m["policy/loss"] - expect.item()) <= 1e-6


def test_keep_checkpoints(tmp_path):
    tok, policy = _setup()
    for keep in (1, 2):
        cfg = _cfg(tmp_path, "train.steps=4", f"train.keep_checkpoints={keep}")  # checkpoints at steps 2, 4
        run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / f"k{keep}", progress=False)
        kept = sorted(p.name for p in (tmp_path / f"k{keep}" / "ckpt").iterdir() if p.name.startswith("step_"))
        assert kept == ["step_000002", "step_000004"][-keep:], kept


def test_arms_rollouts_identically_distributed(tmp_path):
    """Same seed, one RL step each with many samples: the reward distribution of plain and
    speculative rollouts agree within sampling noise (4 standard errors)."""
    tok, policy = _setup(1)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    cfg = _cfg(tmp_path, "train.steps=1", "rollout.prompts_per_step=64", "rollout.group_size=8",
               "rollout.max_new_tokens=4")
    stats = {}
    for arm in ("none", "frozen", "cotrained"):
        rows = run_arm(cfg, arm, policy, draft, DigitTask(), tok, tmp_path / arm, progress=False)
        stats[arm] = rows[0]
    n = 64 * 8
    for arm in ("frozen", "cotrained"):
        assert stats[arm]["tau"] > 1.0 or arm == "none"
        for key in ("reward", "completion_len"):
            a, b = stats["none"][key], stats[arm][key]
            se = max(0.02, math.sqrt(max(a * (1 - a), 0.01) / n) if key == "reward" else 0.05)
            assert abs(a - b) < 4 * se * (1 if key == "reward" else 4), (arm, key, a, b)


def test_rows_at_max_counts_the_rows_cut_off_by_max_new_tokens(tmp_path):
    """rollout/rows_at_max: the fraction of rows whose completion reached rollout.max_new_tokens (the rows
    whose acceptance sets a rollout's number of target forwards), counted from the recorded rollouts."""
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=2")
    record = []
    rows = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "none", progress=False, record=record)
    for r, ro in zip(rows, record):
        cut = [len(c) >= cfg.rollout.max_new_tokens for _, c in ro.pairs]
        assert r["rollout/rows_at_max"] == pytest.approx(sum(cut) / len(cut))
        # plain decoding: the slowest row is a longest one, one token per round
        assert r["rollout/slowest_row_tau"] == 1.0
        assert r["rollout/slowest_row_rounds"] == max(len(c) for _, c in ro.pairs) - 1
        assert isinstance(r["rollout/slowest_row_text"], str)
    assert any(0 < r["rollout/rows_at_max"] < 1 for r in rows), [r["rollout/rows_at_max"] for r in rows]


def test_tail_metrics_hand_computed():
    """rollout/slowest_row_*: the row with the most decode rounds, its tokens per round; the rows cut off at
    max_new_tokens pooled."""
    from types import SimpleNamespace
    from specco.runner.rollouts import tail_metrics
    from specco.rollout.generate import Phase
    out = SimpleNamespace(lengths=torch.tensor([9, 4, 9, 2]), row_rounds=torch.tensor([4, 3, 2, 1]),
                          phases=(Phase(8, 3, 0.5, 18, 6), Phase(4, 1, 0.25, 1, 1)))
    m = tail_metrics(out, max_new_tokens=9, texts=["a" * 500, "b", "c", "d"])
    assert m == {"rollout/slowest_row_rounds": 4, "rollout/slowest_row_tau": 8 / 4,
                 "rollout/slowest_row_text": f"{'a' * 200} … {'a' * 200}",
                 "rollout/tau_rows_at_max": (8 + 8) / (4 + 2), "rollout/tail_rounds": 1, "time/rollout_tail": 0.25,
                 "time/rollout_phases": "8 rows x 3 rounds 0.50 s tau 3.00 | 4 rows x 1 rounds 0.25 s tau 1.00"}
    assert "rollout/tau_rows_at_max" not in tail_metrics(out, max_new_tokens=10, texts=["a", "b", "c", "d"])


def test_measured_speedup_hand_computed():
    """rollout/measured_speedup: plain decoding of each level's tokens (τ_l · rounds_l plain rounds at the
    level's measured plain cost) over the call's decode seconds; None without costs for every level."""
    from types import SimpleNamespace
    from specco.rollout.control import Choice
    from specco.rollout.generate import Phase
    from specco.runner.rollouts import measured_speedup
    choices = (Choice(8, 3, 2.0, {0: 2.0, 3: 4.0}), Choice(8, 1, 1.5, {0: 2.0, 1: 3.0}),  # a re-choice at 8 rows
               Choice(4, 1, 1.2, {0: 1.0, 1: 1.5}))
    phases = (Phase(8, 10, 0.05, 240, 80), Phase(4, 20, 0.04, 60, 40))  # τ 3 and 1.5
    out = SimpleNamespace(choices=choices, phases=phases)
    plain = 3 * 10 * 2.0e-3 + 1.5 * 20 * 1.0e-3  # s
    assert measured_speedup(out) == pytest.approx(plain / 0.09)
    assert measured_speedup(SimpleNamespace(choices=choices[:2], phases=phases)) is None  # no costs at 4 rows
    assert measured_speedup(SimpleNamespace(choices=(), phases=phases)) is None


def test_rollouts_stop_at_every_stop_id_of_the_tokenizer(tmp_path):
    """The RL loop's engine ends rows at any of `tokenizer.stop_ids` (a checkpoint's generation_config list),
    not at eos alone: with a frequent token added as a stop id, rows end there (`record` holds the rollouts)."""
    from specco.data.tokenizer import Tokenizer
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=1", "rollout.max_new_tokens=12")
    seen = []
    run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / "a", progress=False, record=seen)
    completions = [c for _, c in seen[0].pairs]
    counts = torch.bincount(torch.tensor([t for c in completions for t in c[:-1]]), minlength=tok.vocab_size)
    counts[tok.eos_id] = 0
    extra = int(counts.argmax())  # a token some rows emit before their end
    two = Tokenizer(tok.backend, tok.bos_token, tok.eos_token, tok.pad_token, stop_ids=(tok.eos_id, extra))
    assert two.stop_ids == (tok.eos_id, extra) and tok.stop_ids == (tok.eos_id,)
    seen2 = []
    run_arm(cfg, "none", policy, None, DigitTask(), two, tmp_path / "b", progress=False, record=seen2)
    ends = [c[-1] for _, c in seen2[0].pairs if len(c) < 12]
    assert extra in ends  # some rows stopped at the added id
    assert all(extra not in c[:-1] and tok.eos_id not in c[:-1] for _, c in seen2[0].pairs)  # and at its first


def test_measure_tau_runs_at_the_fixed_k(monkeypatch):
    """The warm start's real τ measures the draft at its k: speculation control is off even when the run's
    rollout config has it on (with it, the tail re-check's k choices lowered a warm DFlash draft's τ)."""
    import specco.runner.warmstart as ws
    from specco.rollout.generate import GenerateConfig
    tok, policy = _setup()
    seen = []

    class Engine(ws.RolloutEngine):
        def __init__(self, policy, draft, cfg, **kw):
            seen.append(cfg)
            super().__init__(policy, draft, cfg, **kw)
    monkeypatch.setattr(ws, "RolloutEngine", Engine)
    cfg = GenerateConfig(max_new_tokens=5, num_draft_tokens=2, spec_control=True, eos_token_id=tok.eos_id)
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    res = ws.measure_tau(policy, draft, DigitTask(), 3, cfg, seed=0)
    assert [c.spec_control for c in seen] == [False, False] and all(c.num_draft_tokens == 2 for c in seen)
    assert res["plain"]["tau"] == 1.0 and 1.0 <= res["draft"]["tau"] <= 3.0


def test_tau_full_k():
    """rollout/tau_full_k: 1 + Σ_j Π_{i<=j} α_i from the conditional counts; at a fixed k it equals the call's
    accepted draft tokens per proposing row-round plus one (1 + Σ accept_rate), whatever the stops cut."""
    from specco.rollout.generate import GenerateConfig, generate
    from specco.rollout.sampling import SamplingParams
    from specco.runner.rollouts import tau_full_k
    # hand-computed: α = 0.8, 0.5, and a third position never tried
    assert tau_full_k((torch.tensor([80, 40, 0]), torch.tensor([100, 80, 0]))) == pytest.approx(1 + 0.8 + 0.4)
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    prompts = [tok.encode(s, add_bos=True) for s in ("a", "bb", "abc")]
    cfg = GenerateConfig(max_new_tokens=30, sampling=SamplingParams(temperature=1.0), num_draft_tokens=3,
                         eos_token_id=tok.eos_id, spec_control=False)
    out = generate(policy, prompts, cfg, draft=draft, group_size=4, generator=torch.Generator().manual_seed(0))
    assert out.accept_counts[1][0] > 0
    assert tau_full_k(out.accept_counts) == pytest.approx(1 + float(out.accept_rate.sum()))


def test_step_time_other_is_the_untimed_rest(tmp_path):
    """time/other: the step's wall time outside its timed phases (scoring, batch building, checks), >= 0 and
    below the step's wall time; the frozen arm's draft evaluation is timed apart (time/draft_eval)."""
    import time
    tok, policy = _setup()
    cfg = _cfg(tmp_path, "train.steps=1")
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    for arm in ("none", "frozen"):
        t0 = time.perf_counter()
        rows = run_arm(cfg, arm, policy, None if arm == "none" else draft, DigitTask(), tok, tmp_path / arm,
                       progress=False)
        wall = time.perf_counter() - t0
        r = rows[0]
        parts = sum(r[k] for k in ("time/rollout", "time/logprob", "time/train", "time/refit", "time/refit_guard"))
        assert 0.0 <= r["time/other"] and parts + r["time/other"] <= wall
        assert ("time/draft_eval" in r) == (arm == "frozen")


def test_lr_schedules():
    """train.lr_schedule: the policy's LR decays by cosine to 10% ("cosine", the default) or holds after its
    warmup ("constant"); the draft's ramps over draft_warmup_steps then holds, either way; a bad name is
    refused by name."""
    from specco.config import ConfigError
    from specco.train.cotrain import build_optimizer, build_scheduler
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    for schedule in ("cosine", "constant"):
        opt = build_optimizer(policy, draft, 1e-3, 2e-3)
        sched = build_scheduler(opt, 8, warmup_steps=2, draft_warmup_steps=2, policy_schedule=schedule)
        lrs = []
        for _ in range(8):
            lrs.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
        policy_lr, draft_lr = [x[0] for x in lrs], [x[1] for x in lrs]
        assert policy_lr[:2] == pytest.approx([5e-4, 1e-3]) and draft_lr == pytest.approx([1e-3] + [2e-3] * 7)
        if schedule == "constant":
            assert policy_lr[2:] == pytest.approx([1e-3] * 6)
        else:  # cosine from the peak at the end of warmup towards 10% at the last step
            assert policy_lr[2] == pytest.approx(1e-3) and all(a > b for a, b in zip(policy_lr[2:], policy_lr[3:]))
            assert policy_lr[-1] > 1e-4
    with pytest.raises(ConfigError, match="train.lr_schedule='linear'"):
        _cfg(None, "train.lr_schedule=linear")
