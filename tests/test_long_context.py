"""The long-context workload (configs/long_context.toml, data.format = "lookup"): the task's definition, and its RL
recipe under context parallelism at a small size.

The task: a chain_sum chain whose one-digit terms are named facts hidden in a ledger of distractors; the
completion resolves every name, then works the sum as the "rewrite" format does (data/procedural.lookup_task).

CP: the config's own recipe (group 4, activation checkpointing, one update per step, co-trained EAGLE-3 and
DFlash) with lookup prompts of ~150-200 tokens and the demo's fp64 models, two RL steps at cp = 2 and 4 against
one process (the CP group's rank 0 samples with the single process's generator, so both decode the same
rollouts): losses, grad norms, simulated tau and every parameter. Tolerances as tests/test_rl_cp.py (fp64:
rtol 1e-9, parameters atol 1e-10; policy/loss 1e-6, its log-probs are fp32 by design). The reward is the digits'
share of the completion (as test_grpo's DigitTask): random models never answer a lookup, and a zero reward would
leave the policy's gradient zero and the comparison empty.
"""
import math
import re
from pathlib import Path

import pytest
import torch

from specco.config_load import load_config
from specco.data.procedural import LOOKUP_KEYS, lookup_context_length, lookup_task, reasoning_gym_score
from specco.data.source import load_data
from specco.data.tokenizer import build_char_tokenizer
from specco.model.config import ConfigError
from specco.parallel.mesh import Mesh, spawn_local

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_context.toml"


def _facts(prompt: str) -> dict[str, str]:
    ledger = prompt.rsplit("\n?", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"(?:^|;)([A-Z])=(\d)", ledger)}


@pytest.mark.unit
def test_lookup_task_hides_each_term_once_and_resolves_it_in_the_completion():
    expr = "4 - 1 - 7 + 3 + 9"
    prompt, worked, direct = lookup_task(expr, (2000, 2000), "0:5", 8)
    ledger, question = prompt.rsplit("\n?", 1)
    assert abs(len(prompt) - 2000) <= 5  # the ledger fills the requested length (entries of 5 characters)
    names = re.findall(r"[A-Z]", question)
    assert len(names) == 5 and len(set(names)) == 5 and question.endswith("=")
    assert question == names[0] + "-" + names[1] + "-" + names[2] + "+" + names[3] + "+" + names[4] + "="
    for nm in names:  # each fact's name is in the ledger exactly once; no distractor is uppercase
        assert len(re.findall(rf"(?:^|;){nm}=", ledger)) == 1
    assert len(re.findall(r"[A-Z]", ledger)) == 5
    facts = _facts(prompt)
    assert [facts[nm] for nm in names] == ["4", "1", "7", "3", "9"]
    head, rest = worked.split("\n", 1)
    assert head == ",".join(f"{nm}={facts[nm]}" for nm in names)
    assert rest.startswith("+004-1-7+3+9") and worked.endswith(">8") and direct == head + "\n>8"
    # the positions spread through the ledger (not all at one end) and depend on the key, deterministically
    pos = sorted(ledger.index(f"{nm}=") for nm in names)
    assert pos[-1] - pos[0] > 500
    assert lookup_task(expr, (2000, 2000), "0:5", 8) == (prompt, worked, direct)
    assert lookup_task(expr, (2000, 2000), "0:6", 8)[0] != prompt


@pytest.mark.unit
def test_lookup_lengths_are_log_uniform_and_bad_chains_are_refused():
    import random
    rng = random.Random(0)
    xs = [lookup_context_length(1024, 32768, rng) for _ in range(4000)]
    assert min(xs) >= 1024 and max(xs) <= 32768
    # log-uniform: the log-lengths' quartiles sit at 1/4, 1/2, 3/4 of [log lo, log hi] (sampling error ~0.02)
    logs = sorted((math.log(x) - math.log(1024)) / math.log(32) for x in xs)
    for q in (0.25, 0.5, 0.75):
        assert abs(logs[int(q * len(logs))] - q) < 0.03
    with pytest.raises(ValueError, match="one-digit terms"):
        lookup_task("12 + 3", (100, 100), "k", None)
    with pytest.raises(ValueError, match=f"{len(LOOKUP_KEYS)} letters"):
        lookup_task(" + ".join(["1"] * 27), (100, 100), "k", None)


@pytest.mark.unit
def test_lookup_source_prompts_in_range_and_references_score_full_marks():
    cfg = load_config(CONFIG, ["data.context_tokens=[400,600]", "data.eval_size=4"])
    tok = build_char_tokenizer()
    train, eval_, stats = load_data(cfg.data, tok)
    for e in train.examples(6, seed=0) + eval_.examples(4, seed=0):
        assert 400 <= len(e.prompt_ids) <= 606  # + <bos>, and at most one 5-character entry over
        assert reasoning_gym_score(e.reference, e.columns, cfg.data.options) == 1.0
        assert reasoning_gym_score(e.reference.replace(">", ">1"), e.columns, cfg.data.options) < 1.0  # partial credit
    # the SFT data takes sft.context_tokens; other formats refuse a context length by name
    from specco.runner.validate import load_sft
    sft = load_sft(load_config(CONFIG, ["sft.context_tokens=[300,300]"]), tok)
    assert all(len(e.prompt_ids) <= 306 for e in sft.examples(4, seed=0))
    with pytest.raises(ConfigError, match="only the 'lookup' format"):
        load_config(CONFIG, ["data.format=rewrite"])
    with pytest.raises(ConfigError, match=r"16 <= lo <= hi"):
        load_config(CONFIG, ["data.context_tokens=[600,400]"])


def _lc_worker(rank, world, tmp, cp, arm):
    from test_grpo import DigitTask
    from test_rl_cp import _close, _flat, _models
    from specco.runner.rl import run_arm
    from specco.runner.validate import JobData
    from specco.runner.warmstart import new_block_draft
    tmp = Path(tmp)
    tok, policy, draft = _models()
    if arm == "cotrained-dflash":
        torch.manual_seed(1)
        draft = new_block_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), "dflash", gamma=2).double()
    over = ["device=cpu", "data.context_tokens=[150,200]", "data.options.min_terms=3", "data.options.max_terms=4",
            "train.steps=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=6", "rollout.k=2",
            "rollout.block_k=2", "rollout.dtype=float32", "train.amp=none", "train.lr=3e-3",
            "train.draft_warmup_steps=0", "train.width_multiple=1", "draft.num_anchors=4", f"out_dir={tmp}",
            "plain_baseline=[]", "frozen_shadow=[]", "shadow_window=0",  # measurement hooks: not what CP changes
            "train.share_prompts=false"]  # one device only (tests/test_shared_prompts.py: equal to padded rows)
    cfg = load_config(CONFIG, over)
    train, _, _ = load_data(cfg.data, tok)
    data = JobData(train=train, eval=None, sft=None, rewards=DigitTask().rewards, stats={})
    assert cfg.train.activation_checkpointing and cfg.rollout.group_size == 4
    ref_state, ref_rec = {}, []
    ref = run_arm(cfg, arm, policy, draft, data, tok, tmp / f"ref{rank}", progress=False, state_out=ref_state,
                  record=ref_rec)
    st, rec = {}, []
    rows = run_arm(load_config(CONFIG, over + [f"parallel.cp={cp}"]), arm, policy, draft, data, tok, tmp / "cp",
                   progress=False, mesh=Mesh.build(1, cp), state_out=st, record=rec)
    assert len(rows) == 2 and max(len(p[0]) for p in rec[0].pairs) >= 150  # the lookup prompts, whole
    for a, b in zip(rec, ref_rec):  # the same rollouts on every CP rank
        assert a.pairs == b.pairs
    for r, q in zip(rows, ref):
        _close(r["policy/loss"], q["policy/loss"], "policy/loss", 1e-6)
        for k in ("draft/loss", "policy/grad_norm", "draft/grad_norm", "draft/sim_accept_len", "draft/tokens"):
            _close(r[k], q[k], k)
        assert r["reward"] == q["reward"] and q["policy/grad_norm"] > 0
    torch.testing.assert_close(_flat(st["state"]), _flat(ref_state["state"]), rtol=1e-9, atol=1e-10)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("cp,arm", [(2, "cotrained"), (2, "cotrained-dflash"), (4, "cotrained")])
def test_long_context_recipe_under_cp_equals_one_process(tmp_path, cp, arm):
    spawn_local(_lc_worker, cp, str(tmp_path), cp, arm)
