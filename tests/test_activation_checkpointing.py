"""Activation checkpointing (specco/train/activation_checkpointing.py) changes no value or gradient.

A whole co-training step (GRPO policy loss + K = 3 TTT draft loss on the policy's taps, one backward,
one optimizer step) with and without checkpointing, fp64: losses, every gradient and the updated
parameters agree to 1e-12 (the recomputed forward is the same arithmetic; only the order in which
autograd frees and recomputes buffers differs). The CP variant is in test_cp_cotrain.py. Also: fewer
bytes are saved for the backward, no-grad / cached forwards bypass it, and a deep copy of a
checkpointed policy runs its own weights.
"""
import copy

import pytest
import torch

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft
from specco.model.policy import Policy
from specco.train.activation_checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step

V = 53


def _models():
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2)
    policy = Policy(pc).double()
    draft = Eagle3Draft(DraftConfig.for_policy(pc, aux_layer_ids=(0, 2, 3))).double()
    return policy, draft


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (3, 19), generator=g)
    mask = torch.zeros(3, 19, dtype=torch.float64)
    mask[:, 5:] = 1
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(3, generator=g, dtype=torch.float64),
                      logp_old=-torch.rand(3, 19, generator=g, dtype=torch.float64) * 3)


def _step(ckpt: bool):
    policy, draft = _models()
    if ckpt:
        apply_activation_checkpointing(policy)
    opt = build_optimizer(policy, draft, 1e-3, 1e-2)
    m = cotrain_step(policy, draft, _batch(), opt, None, StepConfig(ttt_passes=3, loss_chunk=7, draft_row_stride=1))
    named = [(f"{t}.{n}", p) for t, mod in (("policy", policy), ("draft", draft)) for n, p in mod.named_parameters()]
    return m, {n: p.grad.clone() for n, p in named}, {n: p.detach().clone() for n, p in named}


@pytest.mark.e2e
def test_checkpointed_step_equals_plain_step():
    m0, g0, p0 = _step(False)
    m1, g1, p1 = _step(True)
    for key in ("policy/loss", "draft/loss", "policy/grad_norm", "draft/grad_norm"):
        assert abs(m1[key] - m0[key]) <= 1e-12 * max(1.0, abs(m0[key])), key
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-12, atol=1e-14, msg=lambda s: f"grad {n}: {s}")
        torch.testing.assert_close(p1[n], p0[n], rtol=1e-12, atol=1e-14, msg=lambda s: f"param {n}: {s}")


def _saved_bytes(policy, tokens):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy(tokens).logits.sum().backward()
    return total


def test_checkpointing_saves_less_and_is_bypassed_without_grad():
    policy, _ = _models()
    tokens = _batch().tokens
    plain = _saved_bytes(policy, tokens)
    apply_activation_checkpointing(policy)
    apply_activation_checkpointing(policy)  # idempotent
    ckpt = _saved_bytes(policy, tokens)
    assert ckpt < 0.6 * plain, (ckpt, plain)
    with torch.no_grad():  # bypass: plain forward, same result
        out_ckpt = policy(tokens).logits
    remove_activation_checkpointing(policy)
    assert "forward" not in policy.layers["0"].__dict__
    with torch.no_grad():
        torch.testing.assert_close(out_ckpt, policy(tokens).logits, rtol=0, atol=0)


def test_deepcopy_of_checkpointed_policy_runs_its_own_weights():
    policy, _ = _models()
    apply_activation_checkpointing(policy)
    twin = copy.deepcopy(policy)
    with torch.no_grad():
        for p in twin.layers["1"].parameters():
            p.mul_(0.5)
    tokens = _batch().tokens
    a, b = policy(tokens).logits, twin(tokens).logits  # grad enabled: the checkpointed path
    assert not torch.allclose(a, b)
    remove_activation_checkpointing(twin)
    torch.testing.assert_close(twin(tokens).logits, b, rtol=1e-12, atol=1e-12)


def test_rejects_a_model_without_layers():
    with pytest.raises(ValueError, match="no `layers`"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))
