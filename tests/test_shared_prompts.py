"""A prompt group's shared prompt run once (parallel/shared_prompts.py, `train.share_prompts`): the packed forward
and the whole co-training step equal the padded rows' (fp64), for no draft, EAGLE-3 and DFlash, whole-batch and
micro-batched, and the log-prob recompute too.

Tolerances: fp64; the packed and padded forwards differ only in the association order of the attention's and
the matmuls' sums (other shapes), ~1e-16 relative per op, which the forward check sees (1e-10). The gradients
are checked to 1e-6 relative: RMSNorm normalises in fp32 whatever the input (model/layers.py, as HF's), so those
1e-16 differences flip an fp32 rounding here and there (measured: ~3e-8 of the largest gradient element), while a
wrong mask or a lost segment moves them by O(1). The sharing must really happen (the policy sees fewer columns than the rows hold)
and the attention core must matter: plain causal attention over the packed row fails the forward check."""
import dataclasses

import pytest
import torch

from specco.model.policy import Policy
from specco.parallel.layout import PADDED, SHARED_PROMPTS
from specco.parallel.shared_prompts import prompt_groups, shared_micro_batches
from specco.train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step

from test_long_prompt_cut import PC, _models


def _batch():
    """9 rows of 40 columns in 3 prompt groups (prompts of 21, 16 and 9 tokens; groups of 4, 3 and 2 rows, not
    contiguous), completions of 1-14 tokens, right-padded; per-row advantages, old and reference log-probs."""
    g = torch.Generator().manual_seed(5)
    B, S = 9, 40
    prompts = [torch.randint(1, 60, (n,), generator=g) for n in (21, 16, 9)]
    rows = [(0, 8), (1, 14), (0, 3), (2, 10), (0, 12), (1, 1), (2, 5), (1, 9), (0, 6)]
    tokens = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S)
    for b, (p, c) in enumerate(rows):
        P = len(prompts[p])
        tokens[b, :P] = prompts[p]
        tokens[b, P:P + c] = torch.randint(1, 60, (c,), generator=g)
        mask[b, P:P + c] = 1
    return TrainBatch(tokens=tokens, target_mask=mask, advantages=torch.randn(B, generator=g),
                      logp_old=-torch.rand(B, S, generator=g) * 3, logp_ref=-torch.rand(B, S, generator=g) * 3)


def test_groups_and_packing():
    batch = _batch()
    groups, first, end = prompt_groups(batch)
    assert groups == [[0, 2, 4, 8], [1, 5, 7], [3, 6]]
    (sel, sh), = list(shared_micro_batches(batch, 0, draft_stride=2))
    assert [int(i) for i in sel] == [i for i, r in enumerate(r for grp in groups for r in grp) if r % 2 == 0]
    # packed row 0: prefix of 20, then segments of 1 + completion length: 9, 4, 13, 7
    assert sh.prefix == [20, 15, 8] and sh.segments[0] == [(20, 9), (29, 4), (33, 13), (46, 7)]
    assert sh.batch.tokens.shape == (3, 54) and sh.rows.tokens.shape == (9, 33)
    assert sh.batch.tokens.numel() < 0.6 * sh.rows.tokens.numel()  # sharing happened
    # every row column up to the row's end reads back its own token and mask through the map, and its log-probs
    # from the column before its first trained token on (a prompt column's log-prob is its group's first row's)
    order = [r for grp in groups for r in grp]
    col = torch.arange(sh.rows.tokens.shape[1])[None]
    for f in ("tokens", "target_mask", "logp_old", "logp_ref"):
        a, b = getattr(sh.rows, f), sh.unpack(getattr(sh.batch, f))
        on = (col < end[order][:, None]) & (col >= first[order][:, None] - 1 if f.startswith("logp") else True)
        assert torch.equal(a[on], b[on]), f
    assert int(sh.batch.target_mask.sum()) == int(batch.target_mask.sum())


def _forward(policy, tokens, positions=None, core=None):
    return policy(tokens, positions, tap_layers=(0, 2, 3), attn_core=core)


def test_prefix_rounded_down_to_the_width_multiple():
    """Under train.width_multiple the shared prefixes' lengths are multiples of it (few distinct lengths for a
    kernel that plans per shape), the rest of each prompt run in every segment; the maps stay exact."""
    batch = _batch()
    groups, first, end = prompt_groups(batch)
    (_, sh), = list(shared_micro_batches(batch, 0, width_multiple=8))
    assert sh.prefix == [16, 8, 8] and sh.segments[0] == [(16, 13), (29, 8), (37, 17), (54, 11)]
    assert sh.batch.tokens.shape == (3, 72)  # 16 + 13 + 8 + 17 + 11 + 1 padding column, rounded up to 8
    order = [r for grp in groups for r in grp]
    on = torch.arange(sh.rows.tokens.shape[1])[None] < end[order][:, None]
    for f in ("tokens", "target_mask", "positions"):
        a = sh.rows.tokens if f == "tokens" else (sh.rows.target_mask if f == "target_mask" else
                                                   torch.arange(sh.rows.tokens.shape[1]).expand_as(sh.rows.tokens))
        assert torch.equal(a[on], sh.unpack(getattr(sh.batch, f))[on].to(a.dtype)), f


@pytest.mark.parametrize("core,multiple", [("shared", 1), ("shared", 8), ("causal", 1)])
def test_packed_forward_equals_rows(core, multiple):
    torch.manual_seed(0)
    policy = Policy(PC).double()
    batch = _batch()
    (_, sh), = list(shared_micro_batches(batch, 0, width_multiple=multiple))
    rows = _forward(policy, sh.rows.tokens)
    packed = _forward(policy, sh.batch.tokens, sh.batch.positions, sh.attn_core if core == "shared" else None)
    _, _, end = prompt_groups(batch)
    order = [r for grp in prompt_groups(batch)[0] for r in grp]
    on = torch.arange(sh.rows.tokens.shape[1])[None] < end[order][:, None]  # (R, W): the rows' real columns
    pairs = [(rows.logits, sh.unpack(packed.logits)), (rows.taps.aux, sh.unpack(packed.taps.aux)),
             (rows.taps.embed, sh.unpack(packed.taps.embed))]
    if core == "causal":  # segments attending to the segments before them: the check must see it
        assert not torch.allclose(pairs[0][0][on], pairs[0][1][on], rtol=1e-6, atol=1e-6)
        return
    for a, b in pairs:
        torch.testing.assert_close(b[on], a[on], rtol=1e-10, atol=1e-12)
    cut = sh.unpack(_forward(policy, sh.batch.tokens, sh.batch.positions, sh.attn_core).logits, 0)
    torch.testing.assert_close(cut, pairs[0][1])


@pytest.mark.parametrize("kind", ["none", "eagle3", "dflash"])
@pytest.mark.parametrize("micro,multiple", [(0, 1), (4, 1), (4, 8)])
def test_step_equals_padded(kind, micro, multiple):
    """One co-training step on shared prompts equals the padded rows' step: every gradient and metric."""
    res = []
    for layout in (PADDED, SHARED_PROMPTS):
        policy, draft = _models(kind)
        seen = []
        policy.register_forward_hook(lambda mod, args, out: seen.append(args[0].numel()))
        opt = build_optimizer(policy, draft, 1e-3, 1e-2)
        cfg = StepConfig(ttt_passes=3, draft_row_stride=2, micro_batch_rows=micro, policy_grad_clip=1e9,
                         draft_grad_clip=1e9, kl_coef=0.1, width_multiple=multiple)
        m = cotrain_step(policy, draft, _batch(), opt, None, cfg, layout=layout)
        res.append((m, [p.grad.clone() for p in policy.parameters()],
                    [] if draft is None else [p.grad.clone() for p in draft.parameters() if p.grad is not None],
                    sum(seen)))
    (m0, gp0, gd0, n0), (m1, gp1, gd1, n1) = res
    # the policy saw the shared prompts once (less shared at multiple 8: these prompts are 9-21 tokens)
    assert n1 < n0 * (0.6 if multiple == 1 else 0.7), (n0, n1)
    assert kind == "none" or (gd0 and len(gd0) == len(gd1))
    for a, b in zip(gp0 + gd0, gp1 + gd1):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    for k in m0:
        if k.startswith(("policy/", "draft/")):
            assert abs(m0[k] - m1[k]) <= 1e-6 * max(1.0, abs(m0[k])), (k, m0[k], m1[k])


@pytest.mark.parametrize("micro", [0, 4])
def test_logprob_recompute_on_shared_prompts(micro):
    """The recompute (runner/rollouts.Minibatch.logprobs) runs the step's packed forward: an unchanged policy's
    ratio is exactly 1 under the shared layout, and its log-probs equal the padded rows' at trained positions."""
    from specco.runner.rollouts import Minibatch
    policy = _models("none")[0]
    batch = _batch()
    cfg = StepConfig(ttt_passes=3, micro_batch_rows=micro, policy_grad_clip=1e9)
    got = Minibatch(batch, SHARED_PROMPTS, list(range(9))).logprobs(policy, cfg)
    ref = Minibatch(batch, PADDED, list(range(9))).logprobs(policy, cfg)
    at = batch.target_mask[:, 1:] != 0  # log-prob of token j sits at position j - 1
    torch.testing.assert_close(got[:, :-1][at], ref[:, :-1][at], rtol=1e-10, atol=1e-12)
    batch = dataclasses.replace(batch, logp_old=got)
    m = cotrain_step(policy, None, batch, torch.optim.SGD(policy.parameters(), lr=0.0), None, cfg,
                     layout=SHARED_PROMPTS)
    assert m["policy/ratio_dev"] == 0.0 and m["policy/ratio_mean"] == 1.0, m


@pytest.mark.e2e
def test_rl_step_with_shared_prompts_equals_padded(tmp_path):
    """train.share_prompts through the RL trainer (runner/rollouts.minibatches picks the layout; PPO with two
    minibatches, so the log-prob recompute runs too): the same parameters and metrics as padded rows."""
    from specco.parallel.layout import SharedPrompts
    from specco.runner.derive import step_config
    from specco.runner.rollouts import minibatches
    from specco.runner.trainer import train_on_rollouts
    from test_draft_min_tokens import _models as _demo_models
    from test_draft_min_tokens import _rollouts
    from test_draft_update_stride import _arm, _params
    tok, _, _ = _demo_models()
    ro = _rollouts(tok, [6, 5, 4, 6, 3, 6, 5, 2])  # 2 prompts x 4 samples
    res = []
    for share in ("false", "true"):
        _, cfg, st = _arm(tmp_path, f"share_{share}", f"train.share_prompts={share}", "train.ppo_epochs=2")
        mbs = minibatches(ro, 2, step_config(cfg, "cotrained"), tok.pad_id, "cpu", None)
        assert isinstance(mbs[0].layout, SharedPrompts) == (share == "true")
        m = train_on_rollouts(st, cfg, ro, tok.pad_id, "cpu")
        res.append((m, _params(st.policy), _params(st.draft)))
    (m0, p0, d0), (m1, p1, d1) = res
    assert m0["ppo/updates"] == 4
    torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(d1, d0, rtol=1e-6, atol=1e-8)
    for k in ("policy/loss", "policy/grad_norm", "draft/loss", "policy/ratio_mean"):
        assert abs(m0[k] - m1[k]) <= 1e-6 * max(1.0, abs(m0[k])), (k, m0[k], m1[k])


def test_config_refuses_what_it_does_not_implement():
    from specco.config import ConfigError
    from specco.config_load import load_config
    for extra, words in ((["parallel.cp=2"], "parallel.cp=2"), (["parallel.pp=2"], "parallel.pp=2"),
                         (["train.warm_widths=true", "train.width_multiple=64"], "warm_widths")):
        with pytest.raises(ConfigError, match="train.share_prompts") as e:
            load_config("configs/demo.toml", ["train.share_prompts=true", *extra])
        assert words in str(e.value)
    assert load_config("configs/demo.toml", ["train.share_prompts=true"]).train.share_prompts


def test_compiled_layers_reuse_their_graphs_across_micro_batches():
    """train.compile with shared prompts: the attention core stays eager (torch.compiler.disable), so the compiled
    layers' graphs are reused by micro-batches of other prefix and segment lengths (traced into, every micro-batch
    compiled a new graph: 1, 2, 3, ... measured)."""
    from torch._dynamo.utils import counters

    from specco.train.compile import apply_compile
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    policy = Policy(dataclasses.replace(PC, num_layers=2))
    apply_compile(policy, "aot_eager")
    g = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(5):
        B, S = 8, 60
        tokens = torch.randint(1, 60, (B, S), generator=g)
        mask = torch.zeros(B, S)
        P = [int(torch.randint(10, 30, (1,), generator=g)) for _ in range(2)]
        for r in range(B):
            p = P[r // 4]
            tokens[r, :p] = tokens[r // 4 * 4, :p]
            mask[r, p:p + int(torch.randint(1, 25, (1,), generator=g))] = 1
        (_, sh), = list(shared_micro_batches(TrainBatch(tokens=tokens, target_mask=mask), 0))
        policy(sh.batch.tokens, sh.batch.positions, attn_core=sh.attn_core).logits.sum().backward()
        seen.append(counters["stats"]["unique_graphs"])
    assert seen[-1] == seen[1], seen  # the first two micro-batches' shapes (static, then dynamic) compile; no more


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_prefix_segments_attention_equals_the_copied_prefix(heads, kv_heads):
    """prefix_segments_attention (the segments' queries as one block against one prefix, merged with their own
    causal squares) equals causal_sdpa(lower_right=True) over each segment's [prefix, own] keys -- the n copies of
    the prefix it replaces -- in outputs and in the gradients of q, the prefix's k/v (summed over the segments)
    and the own k/v; fp64, 1e-10 (only the association order of the sums differs)."""
    from specco.model.layers import causal_sdpa
    from specco.parallel.shared_prompts import prefix_segments_attention
    g = torch.Generator().manual_seed(3)
    n, L, p, D = 3, 7, 11, 8
    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    q, k_pre, v_pre, k_own, v_own = r(n, heads, L, D), r(1, kv_heads, p, D), r(1, kv_heads, p, D), \
        r(n, kv_heads, L, D), r(n, kv_heads, L, D)
    w = torch.randn(n, heads, L, D, generator=g, dtype=torch.float64)
    got = prefix_segments_attention(q, k_pre, v_pre, k_own, v_own)
    grads = torch.autograd.grad((got * w).sum(), (q, k_pre, v_pre, k_own, v_own))
    want = causal_sdpa(q, torch.cat([k_pre.expand(n, -1, -1, -1), k_own], 2),
                       torch.cat([v_pre.expand(n, -1, -1, -1), v_own], 2), lower_right=True)
    wgrads = torch.autograd.grad((want * w).sum(), (q, k_pre, v_pre, k_own, v_own))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert grads[1].shape == (1, kv_heads, p, D)
