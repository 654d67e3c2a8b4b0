"""train.compile_draft (train/compile.py apply_draft_compile): the co-trained EAGLE-3 draft's per-pass layer work
through torch.compile.

* The TTT draft loss and every draft gradient of a compiled draft against the same draft eager, on ragged widths,
  with backend "aot_eager" (the same graph capture and autograd, no code generation) and "inductor" (slow:
  generated C++ on CPU). Tolerance 1e-5 in fp32:
  a compiled graph may reorder fp32 arithmetic; a wrong method, argument or missing gradient is O(1).
* A deep copy (the frozen shadow, each arm's copy) computes with its own weights; remove undoes it.
* An RL arm with it matches the eager arm's first step; refused by name without train.compile and for block drafters.
"""
import copy

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError, DraftConfig
from specco.model.draft import Eagle3Draft
from specco.runner.rl import run_arm
from specco.runner.warmstart import new_draft
from specco.train.compile import _COMPILED, apply_draft_compile, remove_draft_compile, warm_up_draft
from specco.train.cotrain import StepConfig, TrainBatch
from specco.train.drafters import EAGLE3
from test_grpo import DigitTask, _cfg, _setup
from test_rollout_helpers import tiny_policy
from cli_helpers import DEMO  # noqa: E402


def _draft_loss_and_grads(policy, draft, batch):
    draft.zero_grad()
    with torch.no_grad():
        out = policy(batch.tokens, tap_layers=draft.cfg.aux_layer_ids)
    loss, _ = EAGLE3.loss(draft, policy, out, batch, StepConfig(ttt_passes=3, draft_row_stride=1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_draft_matches_eager_loss_and_gradients(backend):
    _COMPILED.clear()
    policy = tiny_policy(V=32, h=32, layers=3)
    eager = Eagle3Draft(DraftConfig.for_policy(policy.cfg))
    compiled = apply_draft_compile(copy.deepcopy(eager), backend)
    g = torch.Generator().manual_seed(0)
    for width in (11, 17, 9):  # the micro-batch widths vary; dynamic shapes serve them all
        tokens = torch.randint(0, 32, (3, width), generator=g)
        mask = torch.ones(3, width)
        mask[:, :3] = 0
        batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.zeros(3))
        want, want_g = _draft_loss_and_grads(policy, eager, batch)
        got, got_g = _draft_loss_and_grads(policy, compiled, batch)
        assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
        assert want_g.keys() == got_g.keys() and len(want_g) > 0
        for n, w in want_g.items():
            assert torch.allclose(got_g[n], w, atol=1e-5, rtol=0), (n, (got_g[n] - w).abs().max())
    assert {k[2] for k in _COMPILED} == {"attn_input", "qkv", "out", "finish"}
    # a copy computes with its own weights (the wrapper rebinds to the copy's submodules)
    twin = copy.deepcopy(compiled)
    with torch.no_grad():
        twin.midlayer.mlp.down_proj.weight.mul_(3.0)
    assert twin.midlayer.__dict__["finish"].obj is twin.midlayer
    base, _ = _draft_loss_and_grads(policy, compiled, batch)
    other, _ = _draft_loss_and_grads(policy, twin, batch)
    assert abs(base.item() - other.item()) > 1e-4
    remove_draft_compile(compiled)
    assert "finish" not in compiled.midlayer.__dict__ and "qkv" not in compiled.midlayer.self_attn.__dict__


@pytest.mark.e2e
def test_warm_up_draft_leaves_no_state():
    policy = tiny_policy(V=32, h=32, layers=3)
    draft = apply_draft_compile(Eagle3Draft(DraftConfig.for_policy(policy.cfg)), "aot_eager")
    weights = {n: p.detach().clone() for n, p in draft.named_parameters()}
    assert warm_up_draft(draft, None, passes=3) >= 0
    assert all(p.grad is None for p in draft.parameters())
    assert all(torch.equal(p, weights[n]) for n, p in draft.named_parameters())


@pytest.mark.e2e
def test_rl_step_with_a_compiled_draft_matches_eager(tmp_path):
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    _COMPILED.clear()
    rows = {}
    for extra in ((), ("train.compile=aot_eager", "train.compile_draft=true")):
        cfg = _cfg(tmp_path, "train.steps=1", *extra)
        rows[extra] = run_arm(cfg, "cotrained", policy, draft, DigitTask(), tok, tmp_path / str(len(extra)),
                              progress=False)[0]
    a, b = rows.values()
    assert {k[2] for k in _COMPILED if k[2] != "forward"} == {"attn_input", "qkv", "out", "finish"}  # it ran compiled
    assert a["reward"] == b["reward"] and a["completion_len"] == b["completion_len"]
    for k in ("draft/loss", "draft/grad_norm", "policy/loss"):
        assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])


def test_compile_draft_refusals():
    with pytest.raises(ConfigError, match="train.compile_draft=true with train.compile='none'"):
        load_config(DEMO, ["train.compile_draft=true"])
    with pytest.raises(ConfigError, match="compiling a block drafter is not implemented"):
        load_config(DEMO, ["train.compile=inductor", "train.compile_draft=true", "arms=[none,cotrained-dflash]"])
    load_config(DEMO, ["train.compile=inductor", "train.compile_draft=true", "arms=[none,frozen-dflash,cotrained]"])
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        apply_draft_compile(torch.nn.Linear(2, 2), "aot_eager")
