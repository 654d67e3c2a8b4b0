"""train.compile (train/compile.py): the trainer's decoder layers through torch.compile.

* Outputs and gradients of a compiled policy against the same policy eager, on random ragged inputs, for
  "aot_eager" (fast lane: the same graph capture and autograd, no code generation) and "inductor" (slow:
  generated C++ on CPU). Tolerance 1e-5 in fp32: inductor reorders fp32 sums and fuses the norms; a wrong
  layer, argument or missing gradient is O(1).
* One compiled function serves every layer, width and model copy (no recompiles past the dynamic one);
  warm_up compiles both graphs before the first step and leaves no state behind.
* An RL run with train.compile = aot_eager matches the eager run's first-step numbers.
* With activation checkpointing (either order of applying the two): outputs and gradients as eager, the compiled
  forward run twice per layer in a training step (the recompute: the checkpoint really drops the activations) and
  once under no_grad; removing either wrapper leaves the other working.
* Refused by name: an unknown backend, with CP/PP, outside `specco train`.
"""
import copy

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError
from specco.runner.derive import check_parallel
from specco.runner.rl import run_arm
from specco.train.activation_checkpointing import (_layers, apply_activation_checkpointing, checkpointed,
                                                   remove_activation_checkpointing)
from specco.train.compile import _COMPILED, apply_compile, remove_compile, warm_up
from test_grpo import DigitTask, _cfg, _setup
from test_rollout_helpers import tiny_policy
from cli_helpers import DEMO  # noqa: E402


def _loss_and_grads(policy, tokens):
    policy.zero_grad()
    out = policy(tokens)
    loss = out.logits.float().logsumexp(-1).mean()
    loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_layers_match_eager_outputs_and_gradients(backend):
    eager = tiny_policy(V=32, h=32, layers=3)
    compiled = apply_compile(copy.deepcopy(eager), backend)
    torch._dynamo.reset()
    _COMPILED.clear()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(0)
    for width in (11, 17, 9):  # micro-batch widths vary; dynamic=True serves them all
        tokens = torch.randint(0, 32, (3, width), generator=g)
        want_out, want_grads = _loss_and_grads(eager, tokens)
        got_out, got_grads = _loss_and_grads(compiled, tokens)
        assert torch.allclose(got_out, want_out, atol=1e-5, rtol=0), (got_out - want_out).abs().max()
        for n, w in want_grads.items():
            assert torch.allclose(got_grads[n], w, atol=1e-5, rtol=0), (n, (got_grads[n] - w).abs().max())
    assert len(_COMPILED) == 1  # one compiled forward for all three layers
    # one graph for 3 layers x 3 widths: the layers' parameters are graph inputs and the width is dynamic
    # (28 graphs would pass torch's recompile limit of 8, and the rest of the layers would run eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # ... and every copy of the model (each RL arm deep-copies the policy): no recompile per arm, which past the
    # limit would leave the later arms eager
    _loss_and_grads(copy.deepcopy(compiled), tokens)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    remove_compile(compiled)
    assert all("forward" not in layer.__dict__ for layer in compiled.layers.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: inductor's Triton kernels under bf16 autocast")
def test_compiled_layers_match_eager_on_cuda_under_bf16_autocast():
    """The configuration the long workload runs (inductor, bf16 autocast, fp32 weights) against eager in the
    same precision. Tolerance: 3e-2 on logits of O(1) and 5e-2 relative on gradient norms, since bf16 keeps
    8 mantissa bits and the fused kernels round at other points than eager's; a wrong argument or a missing
    gradient is O(1)."""
    eager = tiny_policy(V=64, h=128, layers=3).cuda()
    compiled = apply_compile(copy.deepcopy(eager), "inductor")
    tokens = torch.randint(0, 64, (4, 200), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want_out, want_grads = _loss_and_grads(eager, tokens)
        got_out, got_grads = _loss_and_grads(compiled, tokens)
    assert (got_out.float() - want_out.float()).abs().max() < 3e-2
    for n, w in want_grads.items():
        assert (got_grads[n] - w).norm() <= 5e-2 * w.norm() + 1e-6, n


@pytest.mark.e2e
def test_warm_up_compiles_before_the_first_step_and_leaves_no_state():
    """warm_up: both graphs (train, no-grad) compiled on a dummy batch, no gradient left behind, and later
    real batches of other widths and row counts compile nothing more."""
    policy = apply_compile(tiny_policy(V=32, h=32, layers=2), "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    warm_up(policy, None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert all(p.grad is None for p in policy.parameters())
    assert all(torch.equal(p, weights[n]) for n, p in policy.named_parameters())
    _loss_and_grads(policy, torch.randint(0, 32, (5, 23)))
    with torch.no_grad():
        policy(torch.randint(0, 32, (3, 41)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.e2e
def test_rl_step_with_compiled_layers_matches_eager(tmp_path):
    """The arm's first step (before any update, the same rollouts): loss and gradient norm as eager to
    rounding; the engine keeps its own (uncompiled) copy."""
    tok, policy = _setup()
    _COMPILED.clear()
    rows = {}
    for backend in ("none", "aot_eager"):
        cfg = _cfg(tmp_path, "train.steps=1", f"train.compile={backend}")
        rows[backend] = run_arm(cfg, "none", policy, None, DigitTask(), tok, tmp_path / backend, progress=False)[0]
    assert [k[1] for k in _COMPILED] == ["aot_eager"]  # the arm's trainer ran through the compiled layers
    a, b = rows["none"], rows["aot_eager"]
    assert a["reward"] == b["reward"] and a["completion_len"] == b["completion_len"]
    for k in ("policy/loss", "policy/grad_norm"):
        assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])


def test_compile_refusals():
    with pytest.raises(ConfigError, match="train.compile='fast'"):
        load_config(DEMO, ["train.compile=fast"])
    assert load_config(DEMO, ["train.compile=inductor", "train.activation_checkpointing=true"]).train.compile
    cfg = load_config(DEMO, ["train.compile=inductor", "parallel.cp=2"])
    with pytest.raises(ConfigError, match="context parallelism is not implemented"):
        check_parallel(cfg, 2, "train")
    with pytest.raises(ConfigError, match="specco cotrain-cp"):
        check_parallel(load_config(DEMO, ["train.compile=inductor"]), 1, "cotrain-cp")
    policy = tiny_policy(V=32, h=32, layers=2)
    next(iter(_layers(policy))).forward = lambda *a: None  # a wrapper apply_compile does not know
    with pytest.raises(ValueError, match="already wrapped"):
        apply_compile(policy, "aot_eager")
    with pytest.raises(ValueError, match="compile backend 'x'"):
        apply_compile(tiny_policy(V=32, h=32, layers=2), "x")


@pytest.mark.e2e
@pytest.mark.parametrize("order", ["checkpoint_first", "compile_first"])
def test_compile_with_activation_checkpointing(order, monkeypatch):
    """Checkpointed and compiled layers: eager's outputs and gradients (aot_eager: the same ops, 1e-5 as above; the
    inductor numerics are the first test's, and inductor under the checkpoint ran in bench/long_context_probe.py at a
    tiny size, outside the suite: a cold inductor compile costs ~25 s of CI),
    and the compiled forward runs 2x per layer in a step (forward, then the backward's recompute) and 1x under
    no_grad; 1x per layer in a step without the checkpoint (so the recompute is the checkpoint's)."""
    import specco.train.compile as comp
    eager = tiny_policy(V=32, h=32, layers=3)
    model = copy.deepcopy(eager)
    if order == "checkpoint_first":
        apply_compile(apply_activation_checkpointing(model), "aot_eager")
    else:
        apply_activation_checkpointing(apply_compile(model, "aot_eager"))
    assert all(checkpointed(layer) is not None for layer in _layers(model))
    calls = []
    real = comp._compiled
    monkeypatch.setattr(comp, "_compiled", lambda *a: (calls.append(a), real(*a))[1])
    tokens = torch.randint(0, 32, (3, 13), generator=torch.Generator().manual_seed(1))
    want_out, want_grads = _loss_and_grads(eager, tokens)
    got_out, got_grads = _loss_and_grads(model, tokens)
    assert torch.allclose(got_out, want_out, atol=1e-5, rtol=0)
    for n, w in want_grads.items():
        assert torch.allclose(got_grads[n], w, atol=1e-5, rtol=0), n
    assert len(calls) == 2 * 3
    calls.clear()
    with torch.no_grad():
        model(tokens)
    assert len(calls) == 3
    remove_activation_checkpointing(model)  # compiled, unchecked: one call per layer, the same numbers
    calls.clear()
    got_out, got_grads = _loss_and_grads(model, tokens)
    assert len(calls) == 3 and torch.allclose(got_out, want_out, atol=1e-5, rtol=0)
    apply_activation_checkpointing(model)
    remove_compile(model)  # checkpointed, eager again: no compiled call
    calls.clear()
    got_out, got_grads = _loss_and_grads(model, tokens)
    assert not calls and all(checkpointed(layer) is not None for layer in _layers(model))
    for n, w in want_grads.items():
        assert torch.allclose(got_grads[n], w, atol=1e-5, rtol=0), n
