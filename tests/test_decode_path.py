"""The rollout engine's decode path: its kernels against their torch twins, the cached forwards
against the training forwards, the fused projections' HF layout, and speculation control's rule.

Tolerances. Kernel vs twin on fp32 inputs: 1e-5 absolute on O(1) values — fp32 accumulation in a
different order (split-K over the keys, online softmax) is ~1e-6; a wrong mask or a missed key is
O(0.1). Against fp64 references: the same. bf16 kernels vs their twin: the twin's rounding points
are reproduced, so ≤ 1 bf16 ulp (2^-8 relative) where only the accumulation order differs.
Without CUDA the Triton kernels run under the interpreter (conftest.py).
"""
import pytest
import torch

from specco.model.config import DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft
from specco.model.policy import Policy
from specco.ops.decode_attention import decode_attention, split_plan
from specco.ops.decode_kernels import add_rms_norm, rope_qkv_write, silu_mul
from specco.rollout.control import SpecController
from specco.rollout.forward import RopeTable, draft_step, policy_forward

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _dense_reference(q, k, v, pos):
    """fp64 softmax attention with an explicit mask j <= pos, GQA by repeating K/V. q (B,T,H,D)."""
    B, T, H, D = q.shape
    G = H // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)  # (B, H, S, D)
    s = torch.einsum("bthd,bhsd->bths", q.double(), k) * D ** -0.5
    mask = torch.arange(k.shape[2])[None, None, None, :] <= pos[:, :, None, None].cpu()
    s = s.masked_fill(~mask.to(s.device), float("-inf"))
    return torch.einsum("bths,bhsd->bthd", s.softmax(-1), v)


@pytest.mark.parametrize("B,T,H,Hkv,D,S", [(2, 1, 4, 2, 16, 100), (3, 5, 14, 2, 64, 300),
                                           (1, 3, 8, 8, 32, 70), (2, 1, 6, 2, 80, 130), (1, 1, 2, 1, 16, 700)])
@pytest.mark.e2e
def test_decode_attention_kernel_matches_reference(B, T, H, Hkv, D, S):
    g = torch.Generator().manual_seed(B * 100 + S)
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    # positions anywhere, including the first and the last key of the cache
    start = torch.randint(0, S - T + 1, (B, 1), generator=g)
    start[0] = 0
    start[-1] = S - T
    pos = start + torch.arange(T)
    q, k, v, pos = (x.to(DEV) for x in (q, k, v, pos))
    ref = _dense_reference(q, k, v, pos)
    for impl in ("triton", "torch"):
        out = decode_attention(q, k, v, pos, impl=impl)
        assert out.shape == q.shape
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    # a strided query view (e.g. the transpose of a (B, H, T, D) tensor) reads the same
    out = decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, pos, impl="triton")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_decode_attention_fp32_follows_the_matmul_precision(precision):
    """fp32 reads the cache in full-fp32 FMA under "highest" and through TF32 tensor cores once torch's
    float32 matmul precision allows TF32 (the GPU runs' "high"; 2.9x faster on the H200 at 256 rows).
    Tolerance: 1e-5 for IEEE; for TF32 (10-bit mantissa, relative error 2^-11 per operand) 5e-3 on outputs
    of magnitude ~1 with D = 64 scores of scale ~1. Under CPU's interpreter both are exact fp32."""
    from specco.ops.decode_attention import _ieee
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        g = torch.Generator().manual_seed(5)
        B, T, H, Hkv, D, S = 3, 4, 8, 2, 64, 300
        q = torch.randn(B, T, H, D, generator=g)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        pos = torch.tensor([[0], [150], [S - T]]) + torch.arange(T)
        assert _ieee(q) == (precision == "highest") and not _ieee(q.bfloat16())
        q, k, v, pos = (x.to(DEV) for x in (q, k, v, pos))
        out = decode_attention(q, k, v, pos, impl="triton")
        atol = 1e-5 if precision == "highest" else 5e-3
        torch.testing.assert_close(out.double(), _dense_reference(q, k, v, pos), atol=atol, rtol=0)
    finally:
        torch.set_float32_matmul_precision(prev)


def test_decode_attention_ignores_keys_past_the_position():
    """Garbage (NaN) past each row's position must not leak in: the kernel skips the dead prefix."""
    g = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D, S = 2, 2, 4, 2, 16, 400
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    pos = torch.tensor([[10, 11], [200, 201]])
    ref = _dense_reference(q, k, v, pos)
    for b in range(B):
        k[b, :, pos[b, -1] + 1:] = float("nan")
        v[b, :, pos[b, -1] + 1:] = float("nan")
    out = decode_attention(*(x.to(DEV) for x in (q, k, v, pos)), impl="triton")
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=0)


def test_split_plan_covers_the_cache():
    for B, Hkv, S in [(1, 2, 1200), (32, 2, 1200), (128, 2, 4200), (1, 8, 64), (3, 1, 17)]:
        chunk, ns = split_plan(B, Hkv, S)
        assert chunk % 64 == 0 and (ns - 1) * chunk < S <= ns * chunk


# bf16 only on CUDA: Triton's CPU interpreter emulates bf16 (numpy has none) and does not round the
# way the GPU does, so it would test the interpreter rather than the kernel.
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_add_rms_norm_and_silu_mul_match_twins(dtype):
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 96, generator=g).to(DEV, dtype), torch.randn(5, 96, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(DEV, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    for res in (None, r):
        h_t, y_t = add_rms_norm(x, res, w, 1e-6, impl="triton")
        h_r, y_r = add_rms_norm(x, res, w, 1e-6, impl="torch")
        torch.testing.assert_close(h_t, h_r, **tol)
        torch.testing.assert_close(y_t, y_r, **tol)
    out = torch.zeros(5, 192, device=DEV, dtype=dtype)
    add_rms_norm(x, None, w, 1e-6, out=out[:, 96:], impl="triton")  # a strided destination
    torch.testing.assert_close(out[:, 96:], add_rms_norm(x, None, w, 1e-6, impl="torch")[1], **tol)
    assert (out[:, :96] == 0).all()
    gu = torch.randn(7, 2 * 40, generator=g).to(DEV, dtype)
    torch.testing.assert_close(silu_mul(gu, impl="triton"), silu_mul(gu, impl="torch"), **tol)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_qkv_write_matches_twin(qk_norm):
    g = torch.Generator().manual_seed(2)
    B, T, H, Hkv, D, S = 3, 4, 6, 2, 16, 40
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(DEV)
    rope = RopeTable.build(D, 10000.0, S, DEV, torch.float32, scaling=None)
    pos = (torch.randint(0, S - T, (B, 1), generator=g) + torch.arange(T)).to(DEV)
    qn = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV) if qk_norm else None
    outs = []
    for impl in ("triton", "torch"):
        cache = torch.full((2, 2 * B, Hkv, S, D), 7.0, device=DEV)  # a strided per-layer row view
        kc, vc = cache[0, ::2], cache[1, ::2]
        q = rope_qkv_write(qkv, H, Hkv, D, rope.cos, rope.sin, pos, kc, vc, qn, kn, 1e-6, impl=impl)
        outs.append((q, cache))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    written = outs[0][1][0, ::2].sum(-1) != 7.0 * D  # (B, Hkv, S): where keys landed
    assert written.sum() == B * Hkv * T and (outs[0][1][:, 1::2] == 7.0).all()


def _pair(qk_norm=False, bias=False, seed=0):
    torch.manual_seed(seed)
    pc = PolicyConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_layers=4, num_heads=4,
                      num_kv_heads=2, qk_norm=qk_norm, attention_bias=bias)
    policy = Policy(pc).double().eval()
    draft = Eagle3Draft(DraftConfig.for_policy(pc, 50)).double().eval()
    return policy, draft


@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, False), (False, True)])
@torch.no_grad()
def test_policy_forward_equals_training_forward(qk_norm, bias):
    """Prefill, a k+1 block and single tokens through the cache give the training forward's logits,
    hidden states and taps (fp64, so only the kernels' accumulation order differs: 1e-10)."""
    policy, _ = _pair(qk_norm, bias)
    ids = torch.randint(0, 61, (3, 14))
    aux = (1, 2)
    full = policy(ids, tap_layers=aux)
    cache = policy.new_cache(3, 20, dtype=torch.float64)
    rope = RopeTable.build(policy.cfg.head_dim, policy.cfg.rope_theta, 20, "cpu", torch.float64,
                           scaling=policy.cfg.rope_scaling)
    pos = torch.arange(14).expand(3, 14)
    pieces = [policy_forward(policy, ids[:, :6], pos[:, :6], cache, rope, aux, prefill=True),
              policy_forward(policy, ids[:, 6:11], pos[:, 6:11], cache, rope, aux)]
    pieces += [policy_forward(policy, ids[:, t:t + 1], pos[:, t:t + 1], cache, rope, aux) for t in (11, 12, 13)]
    torch.testing.assert_close(torch.cat([p[0] for p in pieces], 1), full.logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat([p[1] for p in pieces], 1), full.hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat([p[2].aux for p in pieces], 1), full.taps.aux, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat([p[2].embed for p in pieces], 1), full.taps.embed, atol=0, rtol=0)


@torch.no_grad()
def test_draft_step_equals_ttt_pass_one():
    """The cached draft step over anchors 0..S-1 is the training forward's pass 1 (model/ttt.py)."""
    from specco.model.ttt import ttt_forward
    policy, draft = _pair()
    ids = torch.randint(0, 61, (2, 9))
    out = policy(ids, tap_layers=draft.cfg.aux_layer_ids)
    hidden = draft.project_taps(out.taps.aux)
    embed = policy.embed_tokens(ids)
    emb = torch.cat([embed[:, 1:], torch.zeros_like(embed[:, :1])], 1)  # emb(x_{i+1}), as TTT pass 1
    cache = draft.new_cache(2, 12, dtype=torch.float64)
    rope = RopeTable.build(draft.cfg.head_dim, draft.cfg.rope_theta, 12, "cpu", torch.float64,
                           scaling=draft.cfg.rope_scaling)
    pos = torch.arange(9).expand(2, 9)
    a = draft_step(draft, hidden[:, :5], emb[:, :5], pos[:, :5], cache, rope, prefill=True)
    b = draft_step(draft, hidden[:, 5:], emb[:, 5:], pos[:, 5:], cache, rope)
    (ref_out,) = ttt_forward(draft, out.taps.aux, embed, pos, num_passes=1)
    torch.testing.assert_close(torch.cat([a[1], b[1]], 1), ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat([a[0], b[0]], 1), draft.lm_head(draft.norm(ref_out)), atol=1e-10, rtol=0)


def test_fused_projections_load_and_save_in_hf_layout():
    policy, draft = _pair(bias=True)
    sd = policy.state_dict()
    assert "layers.0.self_attn.q_proj.weight" in sd and "layers.0.self_attn.v_proj.bias" in sd
    assert "layers.0.mlp.gate_proj.weight" in sd and not any("qkv_proj" in k or "gate_up" in k for k in sd)
    other, _ = _pair(bias=True, seed=1)
    other.load_state_dict(sd, strict=True)  # HF-named parts concatenate into the fused weights
    for (k, a), b in zip(policy.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    # the parts are views: an in-place copy (the engine's refit) writes the fused parameter
    new = torch.randn_like(sd["layers.1.self_attn.k_proj.weight"])
    other.state_dict()["layers.1.self_attn.k_proj.weight"].copy_(new)
    q_size = policy.cfg.num_heads * policy.cfg.head_dim
    torch.testing.assert_close(other.layers["1"].self_attn.qkv_proj.weight[q_size: q_size + new.shape[0]], new)
    assert set(draft.state_dict()) >= {"midlayer.self_attn.q_proj.weight", "midlayer.mlp.up_proj.weight"}


def test_controller_rule():
    c = SpecController(k_max=4, prior=0.6, min_tries=10)
    costs = {0: 1.0, 1: 1.3, 2: 1.4, 3: 1.5, 4: 1.6}
    # prior 0.6: E[τ_2] = 1 + .6 + .36 = 1.96 -> speedup 1.96 / 1.4 = 1.4 beats k = 1 (1.23)
    assert c.choose(costs, 8).k == 3 or c.choose(costs, 8).k == 2
    best = max(range(1, 5), key=lambda k: c.expected_tokens(k) / costs[k])
    assert c.choose(costs, 8).k == best
    # nothing is accepted: plain decoding wins, whatever the costs of speculation
    c.update(torch.zeros(4, dtype=torch.long), torch.tensor([100, 0, 0, 0]))
    assert c.choose(costs, 8).k == 0 and c.choose(costs, 8).predicted_speedup == 1.0
    # everything accepted and speculation costs little: k_max
    c = SpecController(k_max=4, min_tries=10)
    c.update(torch.full((4,), 100), torch.full((4,), 100))
    assert c.expected_tokens(4) == 5.0 and c.choose(costs, 8).k == 4
    # a near tie is decided for plain decoding (the noise margin)
    assert c.choose({0: 1.0, 1: 2.0 / 1.02}, 8).k == 0
    assert c.choose(costs, 8, allow_speculation=False).k == 0


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_fused_sampling_matches_twin(temperature):
    """The fused row sampler picks the twin's token for every uniform away from a cdf boundary and
    reports the twin's log-prob (fp32 accumulation order: 1e-5)."""
    from specco.rollout.sampling import SamplingParams, pick_tokens_logp
    g = torch.Generator().manual_seed(int(temperature * 10))
    N, V = 6, 5000  # several blocks of the kernel
    logits = (3 * torch.randn(N, V, generator=g)).to(DEV)
    logits[0, 17] = logits[0, 4000] = logits[0].max() + 1  # a tie: the first index wins
    u = torch.rand(N, generator=g).to(DEV)
    params = SamplingParams(temperature=temperature)
    tok_t, lp_t = pick_tokens_logp(logits, params, None if params.greedy else u, impl="triton")
    tok_r, lp_r = pick_tokens_logp(logits, params, None if params.greedy else u, impl="torch")
    assert torch.equal(tok_t, tok_r)
    torch.testing.assert_close(lp_t, lp_r, atol=1e-5, rtol=0)
    if params.greedy:
        assert int(tok_t[0]) == 17


@pytest.mark.e2e
@torch.no_grad()
def test_speculation_control_is_lossless_and_plain_stays_plain():
    """With control on (forced on CPU), greedy outputs equal plain greedy whatever k each level picks;
    choices are recorded per level. A root that decodes plainly runs the tracked plain round while the draft
    promises tokens, so the smaller levels may speculate (here they do: speculation is made cheap there); a
    root left plain untracked (a draft never accepted: E[τ] = 1) makes every smaller level plain."""
    from test_rollout_helpers import structured_pair
    from specco.rollout.generate import DecodeRunner, GenerateConfig, generate
    from specco.rollout.sampling import SamplingParams
    policy, draft = structured_pair(layer_scale=100.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, policy.cfg.vocab_size, (n,), generator=g) for n in (3, 6, 2, 5)]
    base = GenerateConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0), num_draft_tokens=3,
                          compact_below=0.9)
    # an EOS that some rows emit early and others late, so the batch compacts during the generation
    first = generate(policy, prompts, base, group_size=4).tokens
    counts = torch.bincount(first[:, 1:8].flatten(), minlength=policy.cfg.vocab_size)
    base = GenerateConfig(**{**base.__dict__, "eos_token_id": int(counts.argmax()), "pad_token_id": -1})
    plain = generate(policy, prompts, base, group_size=4)
    for forced in (None, 0, "hopeless", 2):
        ctl = SpecController(3)
        runner = DecodeRunner(policy, GenerateConfig(**{**base.__dict__, "spec_control": True}), draft,
                              controller=ctl)
        if forced == "hopeless":  # every position tried often and never accepted
            ctl.update(torch.zeros(3), torch.full((3,), 1e4))
        if forced is not None:  # pin the costs: the rule must pick `forced` at the root (16 rows; "hopeless":
            # 0); on smaller levels speculation is made very cheap, so only the rule for levels keeps k = 0
            def pick(costs, rows, allow=True, live=None, pooled=True, _orig=ctl.choose, _k=forced):
                _k = 0 if _k == "hopeless" else _k
                if rows < 16:
                    return _orig({k: (1.0 if k == 0 else 0.01) for k in costs}, rows, allow, live, pooled)
                return _orig({k: (1.0 if k == 0 else 0.5 if k == _k else 9.0) for k in costs}, rows,
                             _k != 0, live, pooled)
            ctl.choose = pick
        runner.prefill(prompts, 4)
        runner.run()
        out = runner.result()
        assert torch.equal(out.tokens, plain.tokens), forced
        assert out.choices and out.choices[0].rows == 16 and set(out.choices[0].costs_ms) == {0, 1, 2, 3}
        assert len(out.choices) > 1, "no compaction happened: the level rule went untested"
        if forced == 0:  # the root tracks; the cheap smaller levels speculate
            root, below = out.choices[0], out.choices[1:]
            assert root.k == 0 and root.tracked and all(c.k > 0 for c in below) and out.tau > 1.0
        if forced == "hopeless":
            assert all(c.k == 0 and not c.tracked for c in out.choices) and out.tau == 1.0
        if forced == 2:  # speculating levels may keep speculating (here: the cheap k on smaller levels)
            assert out.choices[0].k == 2 and out.tau > 1.0 and all(c.k > 0 for c in out.choices)


@pytest.mark.e2e
@torch.no_grad()
@pytest.mark.parametrize("recheck", [0, 4])
def test_a_level_rechooses_k_from_its_own_rows(recheck, monkeypatch):
    """The tail re-check (control.py): the pooled history says the draft is accepted every time, so the
    root starts at k_max; its own rows accept (nearly) nothing, and with recheck_rounds = 4 the level
    turns plain after 4 rounds, which the pooled estimate alone (recheck 0) never does. Greedy outputs
    stay those of plain decoding either way."""
    from test_rollout_helpers import random_draft, tiny_policy
    from specco.rollout.generate import DecodeRunner, GenerateConfig, generate
    from specco.rollout.levels import Level
    from specco.rollout.sampling import SamplingParams
    policy = tiny_policy()
    draft = random_draft(policy)
    costs = {0: 1.0, 1: 1.2, 2: 1.3, 3: 1.4}  # pinned: CPU timings are noise
    monkeypatch.setattr(Level, "measure", lambda self, iters=5: self.costs.update(costs) or self.costs)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, policy.cfg.vocab_size, (n,), generator=g) for n in (3, 6, 2, 5)]
    cfg = GenerateConfig(max_new_tokens=20, sampling=SamplingParams(temperature=0.0), num_draft_tokens=3,
                         compact_below=0.0, spec_control=True)
    ctl = SpecController(3, min_tries=8, recheck_rounds=recheck)
    ctl.update(torch.full((3,), 10_000), torch.full((3,), 10_000))  # an earlier call accepted everything
    runner = DecodeRunner(policy, cfg, draft, controller=ctl)
    runner.prefill(prompts, 4)
    runner.run()
    out = runner.result()
    assert torch.equal(out.tokens, generate(policy, prompts, cfg, group_size=4).tokens)
    assert out.choices[0].k == 3 and out.choices[0].rows == 16
    if recheck:  # 4 rounds x 16 rows = 64 tries >= min_tries: plain from round 5 on, as the costs say
        assert [c.k for c in out.choices] == [3, 0] and out.choices[1].rows == 16
        assert int(out.accept_counts[1][0]) == 4 * 16  # position 1 was tried in those 4 rounds only
    else:
        assert [c.k for c in out.choices] == [3] and int(out.accept_counts[1][0]) > 4 * 16


def test_fused_modules_pickle_and_copy():
    """A policy crosses ranks by pickling (broadcast_object_list) and the engine deep-copies it: the
    fused layout's state-dict hooks must survive both."""
    import copy
    import pickle
    policy, _ = _pair(bias=True)
    for clone in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy)):
        assert set(clone.state_dict()) == set(policy.state_dict())
        for k, v in policy.state_dict().items():
            assert torch.equal(clone.state_dict()[k], v), k
