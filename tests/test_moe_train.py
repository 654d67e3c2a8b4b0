"""Training a mixture-of-experts policy: the router load-balancing loss (train/moe_loss.py) and the co-training
step with EAGLE-3 / DFlash drafts tapping a MoE policy.

What is compared, with which tolerance:
* `load_balancing_loss` vs transformers' `load_balancing_loss_func` on the same router logits, with and without
  an attention mask: value and gradient, fp32, rtol 1e-6;
* the step's aux term: the policy gradient at coefficient c minus the one at 0 equals c times the gradient of
  `aux_share` computed by hand (fp64 weights; the loss itself is fp32 as in transformers: the error's norm
  <= 1e-5 of the aux gradient's, per parameter), micro-batched; "policy/aux_loss" equals the loss by hand;
* the co-training step on a MoE policy (coefficient 0) with an EAGLE-3 or DFlash draft equals, bit for bit, the
  frozen pp = 1 step of tests/test_one_step.py (taps of MoE layers unchanged), and the policy's gradients do not
  depend on the draft weight;
* refusals by name: the run config's coefficient for a dense policy (the aux loss under a pipe: test_ep_pp.py).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specco.config_load import load_config
from specco.model.config import ConfigError, DraftConfig, PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.draft import Eagle3Draft
from specco.model.policy import Policy
from specco.runner.prepare import with_run_overrides
from specco.train.cotrain import build_optimizer, cotrain_step, micro_batches, step_counts
from specco.train.moe_loss import aux_share, load_balancing_loss
from specco.train.step_config import StepConfig
from test_one_step import LENS, V, _batch, _frozen_step

MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
           model_type="qwen2_moe", attention_bias=True, num_experts=6, num_experts_per_tok=2,
           moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=(1,))


def _policy(dtype, **over) -> Policy:
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(**{**MOE, **over}))
    with torch.no_grad():  # decisive routing: the init's 0.02 router would route nearly uniformly
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return policy.to(dtype)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_equals_transformers(masked):
    hf_loss = pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe").load_balancing_loss_func
    g = torch.Generator().manual_seed(0)
    B, S, E, k = 3, 7, 6, 2
    logits = [torch.randn(B * S, E, generator=g).requires_grad_() for _ in range(3)]
    mask = (torch.rand(B, S, generator=g) > 0.3).long() if masked else None
    want = hf_loss(tuple(logits), E, k, mask)
    got = load_balancing_loss([x.view(B, S, E) for x in logits], k, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    gw = torch.autograd.grad(want, logits)
    gg = torch.autograd.grad(got, logits)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    # uniform routing gives k; a masked-out row changes nothing
    assert abs(load_balancing_loss([torch.zeros(5, E)], k).item() - k) < 1e-6


def _grads_and_metrics(coef: float, cfg: StepConfig):
    policy = _policy(torch.float64, router_aux_loss_coef=coef)
    batch = _batch(torch.float64)
    opt = build_optimizer(policy, None, 0.0, 0.0)  # lr 0: the step leaves the gradients to read
    m = cotrain_step(policy, None, batch, opt, None, cfg)
    return {n: p.grad.clone() for n, p in policy.named_parameters()}, m, batch


def test_aux_loss_enters_the_policy_gradient_with_its_coefficient():
    cfg = StepConfig(micro_batch_rows=2, policy_grad_clip=1e12)
    g0, m0, batch = _grads_and_metrics(0.0, cfg)
    c = 0.3
    gc, mc, _ = _grads_and_metrics(c, cfg)
    # by hand: Σ over micro-batches of aux_share, differentiated on a fresh copy of the same weights
    policy = _policy(torch.float64)
    counts = step_counts(batch, cfg)
    total = 0.0
    for _, mb in micro_batches(batch, cfg.micro_batch_rows, cfg.draft_row_stride):
        out = policy(mb.tokens, mb.positions)
        total = total + aux_share(out.router_logits, 2, mb.target_mask, counts.policy_tokens)
    ga = dict(zip([n for n, _ in policy.named_parameters()],
                  torch.autograd.grad(total, list(policy.parameters()), allow_unused=True)))
    assert mc["policy/aux_loss"] == pytest.approx(total.item(), rel=1e-12)
    assert m0["policy/aux_loss"] == pytest.approx(total.item(), rel=1e-12)  # logged at coefficient 0 too
    assert mc["policy/loss"] == pytest.approx(m0["policy/loss"], rel=1e-12)  # the surrogate alone
    routers = [n for n in g0 if n.endswith("mlp.gate.weight")]
    assert routers and all((gc[n] - g0[n]).abs().max() > 1e-8 for n in routers)
    for n in g0:
        want = g0[n] + c * (ga[n] if ga[n] is not None else 0)
        # the aux loss runs in fp32 whatever the weights' dtype (softmax in fp32, as transformers): ~1e-6 relative
        err, ref = (gc[n] - want).norm().item(), (want - g0[n]).norm().item()
        assert err <= 1e-5 * ref + 1e-12, (n, err, ref)


def test_dense_policy_logs_no_aux_loss():
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                 num_kv_heads=2)).double()
    m = cotrain_step(policy, None, _batch(torch.float64), build_optimizer(policy, None, 1e-3, 1e-3), None,
                     StepConfig())
    assert "policy/aux_loss" not in m


def _draft(kind, pc):
    if kind == "eagle3":
        return Eagle3Draft(DraftConfig.for_policy(pc, aux_layer_ids=(0, 1, 3)))
    return BlockDraft(BlockDraftConfig.for_policy(pc, kind, gamma=3, mask_id=V - 1, num_layers=2, num_anchors=5,
                                                  aux_layer_ids=(0, 1, 3)))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_cotrain_step_on_moe_policy_equals_frozen_step(kind):
    """Taps from sparse (0, 3) and dense (1) layers reach the drafts unchanged: the one step equals the frozen pp = 1
    step bit for bit (coefficient 0: the frozen step has no aux term), and the policy's gradients are the same with
    the draft's weight 0 and 1 (the draft never changes the policy)."""
    cfg = StepConfig(ttt_passes=2, loss_chunk=5, micro_batch_rows=3, draft_row_stride=1)
    runs = {}
    for name, fn, weight in (("frozen", _frozen_step, 1.0), ("step", cotrain_step, 1.0), ("no_draft", cotrain_step, 0.0)):
        policy = _policy(torch.float64)
        torch.manual_seed(1)
        draft = _draft(kind, policy.cfg).double()
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        c = dataclasses.replace(cfg, draft_weight=weight)
        if fn is _frozen_step:
            m = fn(policy, draft, _batch(torch.float64), opt, c)
        else:
            m = fn(policy, draft, _batch(torch.float64), opt, None, c)
        grads = {f"p.{n}": p.grad for n, p in policy.named_parameters()}
        grads.update({f"d.{n}": p.grad for n, p in draft.named_parameters() if p.grad is not None})
        runs[name] = (m, grads)
    (mf, gf), (ms, gs), (_, gn) = runs["frozen"], runs["step"], runs["no_draft"]
    assert ms.pop("policy/aux_loss") > 0
    ms.pop("time/train_draft", None)
    assert ms.keys() == mf.keys() and all(ms[k] == mf[k] for k in mf), [k for k in mf if ms[k] != mf[k]]
    assert gs.keys() == gf.keys() and all(torch.equal(gs[k], gf[k]) for k in gf)
    assert any(k.startswith("d.") and gs[k].abs().max() > 0 for k in gs)
    assert all(torch.equal(gs[k], gn[k]) for k in gs if k.startswith("p."))


def test_run_config_overrides_the_coefficient():
    cfg = load_config(overrides=["policy.router_aux_loss_coef=0.05"])
    policy = with_run_overrides(cfg, _policy(torch.float32, router_aux_loss_coef=0.001))
    assert policy.cfg.router_aux_loss_coef == 0.05
    assert with_run_overrides(load_config(), _policy(torch.float32)).cfg.router_aux_loss_coef == 0.0
    torch.manual_seed(0)
    dense = Policy(PolicyConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2))
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        with_run_overrides(cfg, dense)
    assert len(LENS) == 6  # the shared batch of test_one_step


def test_activation_checkpointing_keeps_moe_gradients_and_aux_loss():
    """Checkpointed layers recompute the router in the backward: the same gradients (fp64, exact) and aux loss."""
    from specco.train.activation_checkpointing import apply_activation_checkpointing
    cfg = StepConfig(micro_batch_rows=3, policy_grad_clip=1e12)
    plain, m_plain, _ = _grads_and_metrics(0.01, cfg)
    policy = apply_activation_checkpointing(_policy(torch.float64, router_aux_loss_coef=0.01))
    m = cotrain_step(policy, None, _batch(torch.float64), build_optimizer(policy, None, 0.0, 0.0), None, cfg)
    assert m["policy/aux_loss"] == m_plain["policy/aux_loss"]
    for n, p in policy.named_parameters():
        assert torch.equal(p.grad, plain[n]), n


def test_moe_layouts_not_implemented_are_refused_by_name(tmp_path):
    """Before out_dir (validate.check_moe_layout) and at the backstops (apply_tp, the sharded load)."""
    from specco.model.hf_io import load_policy_rows, save_policy
    from specco.parallel.tp import apply_tp
    from specco.runner.validate import check_moe_layout
    pc = _policy(torch.float32).cfg
    for over, match in ((["parallel.tp=2"], "parallel.tp=2"),):
        with pytest.raises(ConfigError, match=match):
            check_moe_layout(load_config(overrides=over), pc, "dir/config.json")
    check_moe_layout(load_config(overrides=["parallel.pp=2", "policy.router_aux_loss_coef=0.01"]), pc, "x")  # the
    # balance loss under a pipe: tests/test_ep_pp.py
    check_moe_layout(load_config(overrides=["parallel.dp_shard=2"]), pc, "x")  # FSDP at ep 1: tests/test_ep_fsdp.py
    check_moe_layout(load_config(overrides=["rollout.tp=2", "parallel.cp=2"]), pc, "x")  # tests/test_engine_tp.py
    policy = _policy(torch.float32)

    class _Mesh:
        def size(self):
            return 2
    with pytest.raises(ValueError, match="tensor parallelism of a mixture-of-experts"):
        apply_tp(policy, _Mesh())
    save_policy(policy, tmp_path / "p")
    with pytest.raises(ConfigError, match="sharded load"):
        load_policy_rows(tmp_path / "p", policy)


def test_memory_plan_reads_a_saved_moe_policy(tmp_path):
    """specco plan reads a saved MoE policy's shape from its config.json and counts its parameters exactly
    (tests/test_plan_moe.py checks the formulas)."""
    from specco.model.hf_io import save_policy
    from specco.plan import policy_config, policy_params
    policy = _policy(torch.float32)
    save_policy(policy, tmp_path / "p")
    pc = policy_config(load_config(overrides=[f"policy.source={tmp_path / 'p'}"]))
    assert pc.moe and policy_params(pc) == sum(p.numel() for p in policy.parameters())


def test_resume_checkpoint_round_trips_a_moe_policy(tmp_path):
    """train/checkpoint.py saves the per-expert views and loads them back into the 3-D expert parameters, bit-equal,
    with the optimizer's state."""
    from specco.train.checkpoint import load_checkpoint, save_checkpoint
    policy = _policy(torch.float32)
    opt = build_optimizer(policy, None, 1e-3, 1e-3)
    policy(torch.randint(0, V, (2, 5))).logits.sum().backward()
    opt.step()
    st = load_checkpoint(save_checkpoint(tmp_path, 1, {"policy": policy.state_dict(), "opt": opt.state_dict()}))
    torch.manual_seed(5)
    other = Policy(policy.cfg)
    other.load_state_dict(st["policy"])
    build_optimizer(other, None, 1e-3, 1e-3).load_state_dict(st["opt"])
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), other.parameters()))


@pytest.mark.slow
def test_compiled_moe_layers_equal_eager():
    """train.compile on a MoE policy (aot_eager: the same capture and autograd, no codegen, so CPU-only CI runs it):
    the expert loop graph-breaks at its host read and still computes the same logits, router logits and gradients
    (exactly, aot_eager reorders nothing); ~30 s on 2 cores."""
    import copy
    from specco.train.compile import apply_compile
    eager = _policy(torch.float32)
    compiled = apply_compile(copy.deepcopy(eager), "aot_eager")
    for shape in ((3, 9), (2, 13)):  # a second width: dynamic shapes, no wrong reuse
        ids = torch.randint(0, V, shape)
        a, b = eager(ids), compiled(ids)
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(x, y) for x, y in zip(a.router_logits, b.router_logits))
        for out in (a, b):
            (out.logits.square().sum() + sum(r.square().sum() for r in out.router_logits)).backward()
        for (n, x), y in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(x.grad, y.grad), n
            x.grad = y.grad = None
