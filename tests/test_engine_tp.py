"""Tensor parallelism of the rollout engine (rollout/tp.py), on gloo: 2 ranks, each decoding with its shard.

Every sampler here chooses tokens vocabulary-parallel (never from whole logits): greedy and coupled by a reduction
per row, plain temperature sampling and rejection sampling's verify by inverse CDF block by block; each is checked
against its whole-vocabulary rule on random blocks (with planted ties) and in the engine.

Every case decodes the same prompts with the whole policy (tp 1) and with the rank's shard (tp 2) from the same
generator, fp64 models, and requires the same tokens and lengths: plain decoding, EAGLE-3 and DFlash, greedy,
coupled sampling and rejection sampling at T = 1. The shards' sums differ from the whole policy's only in
summation order (the all-reduce adds two partial o_proj / down_proj outputs), ~1e-16 relative in fp64, far below
any gap between a row's two best logits or between a uniform and an acceptance ratio here. Equal tokens under
rejection sampling from the same uniforms mean the tp 2 engine draws from the tp 1 engine's distribution, whose
losslessness tests/test_speculative.py checks (χ²). A mutation (the all-reduce after the row-parallel projections
dropped) must change the tokens; the refit of whole tensors into a shard keeps exactly the rank's slices.
"""
import pytest
import torch
import torch.distributed as dist

from specco.parallel.mesh import spawn_local

pytestmark = pytest.mark.dist


def _cases():
    from specco.rollout.sampling import SamplingParams
    return {"greedy": SamplingParams(temperature=0.0), "coupled": SamplingParams(temperature=1.0, coupled=True),
            "rejection": SamplingParams(temperature=1.0)}


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 11, 12, 2]]


def tokens(model, draft, params, k=3, prompts=PROMPTS):
    """(tokens, lengths) of one engine call: 12 new tokens, 2 samples per prompt, a fixed generator."""
    from specco.rollout.config import GenerateConfig
    from specco.rollout.engine import RolloutEngine
    cfg = GenerateConfig(max_new_tokens=12, sampling=params, num_draft_tokens=k)
    with RolloutEngine(model, draft, cfg) as eng:
        out = eng.generate(prompts, group_size=2, generator=torch.Generator().manual_seed(7))
    return out.tokens, out.lengths


def assert_refit_keeps_slices(shard, new):
    """The trainer's whole tensors of `new` refit into the tp shard in place (InPlaceLoad): the same storage, each
    rank's slices of `new`, and the tp 1 tokens of `new`."""
    from specco.rollout.tp import tp_shard
    from specco.rollout.weights import InPlaceLoad
    ptrs = [p.data_ptr() for p in shard.parameters()]
    load = InPlaceLoad(shard, "policy")
    load.write(list(new.state_dict().items()))
    load.finish()
    assert ptrs == [p.data_ptr() for p in shard.parameters()]
    want = tp_shard(new, dist.group.WORLD).state_dict()
    for k, v in shard.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(tokens(new, None, _cases()["greedy"])[0], tokens(shard, None, _cases()["greedy"])[0])


def _worker(rank, world):
    from test_block_rollout import _block_draft
    from test_rollout_helpers import random_draft, tiny_policy
    import specco.rollout.forward as fwd
    from specco.rollout.tp import tp_shard
    from specco.rollout.weights import InPlaceLoad
    policy = tiny_policy(V=32, h=32, layers=4, kv=2).double()
    shard = tp_shard(policy, dist.group.WORLD)
    assert shard.cfg.num_heads == 2 and shard.cfg.num_kv_heads == 1 and shard.lm_head.weight.shape == (16, 32)

    drafts = {"plain": None, "eagle3": random_draft(policy).double(), "dflash": _block_draft(policy, "dflash")}
    for dname, draft in drafts.items():
        for cname, params in _cases().items():
            a, b = tokens(policy, draft, params), tokens(shard, draft, params)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (dname, cname, a, b)
    # mutation: without the all-reduce each rank decodes with half of every attention and MLP output
    reduce = fwd.reduce_partial
    fwd.reduce_partial = lambda x, group: x
    try:
        assert not torch.equal(tokens(policy, None, _cases()["greedy"])[0], tokens(shard, None, _cases()["greedy"])[0])
    finally:
        fwd.reduce_partial = reduce
    # refit: the trainer's whole tensors, each rank keeps its slice, in place
    torch.manual_seed(5)
    assert_refit_keeps_slices(shard, tiny_policy(V=32, h=32, layers=4, kv=2, seed=5).double())
    bad = InPlaceLoad(shard, "policy")  # a tensor of the wrong whole size is named, not sliced
    bad.write([("layers.0.self_attn.q_proj.weight", torch.zeros(16, 32, dtype=torch.float64))])
    assert bad.bad_shape and bad.bad_shape[0][0] == "layers.0.self_attn.q_proj.weight"


def _pick_worker(rank, world):
    """pick_vocab_parallel on random blocks equals the whole rule (greedy: argmax and raw log_softmax; coupled:
    argmax(log_softmax(z/T) + G) and its log-prob), ties to the lowest id across the ranks' blocks; the rejection
    verify from blocks equals the whole-logits rule (fp32 sums per block: ties to a cdf boundary within ~1e-7 could
    differ, none among these 128 rows)."""
    from specco.rollout.sampling import SamplingParams, keyed_gumbel
    from specco.rollout.tp import pick_vocab_parallel
    torch.manual_seed(0)
    z = torch.randn(3, 4, 32, dtype=torch.float64)
    z[0, 0, 5] = z[0, 0, 21] = 9.0  # a tie across the two ranks' blocks (ids 5 and 21): id 5 wins
    z[1, 0, 18] = z[1, 0, 30] = 9.0  # within rank 1's block: id 18
    local = z[..., rank * 16:(rank + 1) * 16]
    key, pos = torch.tensor([3, 8, 11]), torch.arange(12).view(3, 4) + 40
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, coupled=True)):
        tok, logp = pick_vocab_parallel(local, params, dist.group.WORLD, key, pos)
        if params.greedy:
            lp = z.float().log_softmax(-1)
            want = z.argmax(-1)
        else:
            lp = (z.float() / 0.7).log_softmax(-1)
            want = (lp + keyed_gumbel(key, pos, 32)).argmax(-1)
        assert torch.equal(tok, want), (params, tok, want)
        torch.testing.assert_close(logp, lp.gather(-1, want[..., None])[..., 0], rtol=0, atol=2e-6)  # fp32 sums
    assert tok.shape == (3, 4) and int(z[0, 0].argmax()) == 5
    # rejection sampling's verify from the blocks == acceptance.verify_sampling_logits on the whole logits: random
    # drafts (rejections, residual draws), a draft equal to the target (all accepted: the bonus draw from p_k)
    from specco.rollout.acceptance import verify_sampling_logits
    from specco.rollout.tp import verify_sampling_vocab_parallel
    B, k, T = 64, 3, 0.8
    g = torch.Generator().manual_seed(1)
    zl = torch.randn(B, k + 1, 32, generator=g, dtype=torch.float64)
    for q in (torch.softmax(torch.randn(B, k, 32, generator=g), -1), (zl[:, :k].float() / T).softmax(-1)):
        d = torch.multinomial(q.reshape(-1, 32), 1, generator=g).view(B, k)
        ua, ur = torch.rand(B, k, generator=g), torch.rand(B, generator=g)
        want, wlogp = verify_sampling_logits(zl, T, q, d, ua, ur, impl="torch")
        got, glogp = verify_sampling_vocab_parallel(zl[..., rank * 16:(rank + 1) * 16], T, q, d, ua, ur,
                                                    dist.group.WORLD)
        assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(glogp.float(), wlogp, rtol=0, atol=2e-6)
    assert int(want.num_accepted.eq(k).sum()) > B // 2  # the second draft is the target: mostly all accepted
    # plain temperature sampling from the blocks == pick_tokens_logp's inverse-CDF draw on the whole logits
    from specco.rollout.sampling import pick_tokens_logp
    from specco.rollout.tp import sample_vocab_parallel
    zs, u = torch.randn(B, 32, generator=g, dtype=torch.float64), torch.rand(B, generator=g)
    want_t, want_lp = pick_tokens_logp(zs, SamplingParams(temperature=T), u, impl="torch")
    got_t, got_lp = sample_vocab_parallel(zs[:, rank * 16:(rank + 1) * 16], T, u, dist.group.WORLD)
    assert torch.equal(got_t, want_t) and len(set(got_t.tolist())) > 8
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-6)


def test_vocab_parallel_pick_equals_the_whole_rule():
    spawn_local(_pick_worker, 2)


def test_engine_tp2_decodes_the_tp1_tokens_and_refits_its_slices():
    spawn_local(_worker, 2)


def _refusal_worker(rank, world):
    from test_block_rollout import _block_draft
    from test_rollout_helpers import tiny_policy
    from specco.rollout.config import GenerateConfig
    from specco.rollout.engine import RolloutEngine
    from specco.rollout.tp import tp_shard
    with pytest.raises(ValueError, match="num_kv_heads = 1 is not divisible by 2"):
        tp_shard(tiny_policy(kv=1), dist.group.WORLD)
    policy = tiny_policy(V=32, kv=2)
    with pytest.raises(ValueError, match="DSpark"):
        RolloutEngine(tp_shard(policy, dist.group.WORLD), _block_draft(policy, "dspark"), GenerateConfig())


def test_engine_tp_refuses_what_it_cannot_split():
    spawn_local(_refusal_worker, 2)

def _control_worker(rank, world):
    """Speculation control on a tensor-parallel engine: each rank's clock says another k pays (rank 0: plain rounds
    cheap, rank 1: speculative ones), yet both choose the same k at every level (Level.measure all-reduces each k's
    cost to the slowest rank's: a round's collectives have k-dependent shapes, so ranks choosing apart would
    deadlock or corrupt) and decode tp 1's tokens at that k path."""
    from test_rollout_helpers import random_draft, tiny_policy
    import specco.rollout.levels as levels
    from specco.rollout.config import GenerateConfig
    from specco.rollout.engine import RolloutEngine
    from specco.rollout.tp import tp_shard
    policy = tiny_policy(V=32, h=32, layers=4, kv=2).double()
    shard, draft = tp_shard(policy, dist.group.WORLD), random_draft(policy).double()

    class Clock:  # measure's (start, end) pairs, one per k in order: k = 0 slow on rank 1, fast on rank 0
        def __init__(self):
            self.t, self.calls = 0.0, 0

        def perf_counter(self):
            if self.calls % 2:
                first = self.calls % 8 == 1  # k = 0 is the first pair of each measurement (4 step sets: k 0..3)
                self.t += (100.0 if first else 1.0) if rank == 1 else (1.0 if first else 100.0)
            self.calls += 1
            return self.t
    cfg = GenerateConfig(max_new_tokens=12, sampling=_cases()["greedy"], num_draft_tokens=3, spec_control=True)
    real = levels.time
    levels.time = Clock()
    try:
        with RolloutEngine(shard, draft, cfg) as eng:
            out = eng.generate([[1, 5, 6, 7], [1, 9]], group_size=2)
    finally:
        levels.time = real
    path = [(c.rows, c.k) for c in out.choices]
    both = [None, None]
    dist.all_gather_object(both, path)
    assert both[0] == both[1] and path, both
    with RolloutEngine(policy, draft, cfg) as eng:  # tokens do not depend on k (greedy speculation is exact)
        ref = eng.generate([[1, 5, 6, 7], [1, 9]], group_size=2)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.lengths, ref.lengths)


def test_engine_tp2_speculation_control_chooses_alike_on_every_rank():
    spawn_local(_control_worker, 2)


def _tracked_worker(rank, world):
    """The tracked plain round (rollout/speculative.py `track`) on the tp 2 engine: its vocabulary-parallel token
    choice and its taps feed the draft as at tp 1, so tracked rounds between speculative ones give tp 1's tokens
    and, the draft state being the same, tp 1's acceptance counts (fp64), for EAGLE-3 and DFlash, every sampler."""
    from test_block_rollout import _block_draft
    from test_rollout_helpers import structured_pair, tiny_policy
    from specco.rollout.generate import DecodeRunner, GenerateConfig
    from specco.rollout.tp import tp_shard
    pairs = {"eagle3": tuple(m.double() for m in structured_pair(V=32)),
             "dflash": (tiny_policy(V=16, h=32, layers=3, seed=5).double(), None)}
    pairs["dflash"] = (pairs["dflash"][0], _block_draft(pairs["dflash"][0], "dflash", gamma=3, scale=3.0).double())
    for kind, (policy, draft) in pairs.items():
        shard = tp_shard(policy, dist.group.WORLD)
        for cname, params in _cases().items():
            runs = []
            for model in (policy, shard):
                cfg = GenerateConfig(max_new_tokens=24, sampling=params, num_draft_tokens=3, spec_control=True,
                                     compact_min_rows=1)
                runner = DecodeRunner(model, cfg, draft)
                runner.prefill([[t % 15 for t in p] for p in PROMPTS], 2, generator=torch.Generator().manual_seed(3))
                level = runner.level
                assert level.tracked is not None
                for k in ["t", "t", 3, "t", 2, "t", 3]:
                    level.k, level.tracking = (0, True) if k == "t" else (k, False)
                    runner.round()
                st = runner.st
                runs.append((st.out_tokens.clone(), st.out_len.clone(), st.n_accepted.clone(), st.n_tried.clone()))
            for a, b in zip(*runs):
                assert torch.equal(a, b), (kind, cname)
            assert int(runs[0][2].sum()) > 0, (kind, cname)  # some draft tokens accepted: the counts compare


def test_engine_tp2_tracked_plain_rounds_equal_tp1():
    spawn_local(_tracked_worker, 2)


def _moe_worker(rank, world):
    """A mixture-of-experts target on the tp 2 engine (rollout/tp.py: each expert's and the shared expert's SwiGLU
    cut I/tp, router whole, the block's output all-reduced): Qwen3-MoE and Qwen2-MoE (shared expert, a dense
    mlp_only layer), plain and EAGLE-3, every sampler, the tp 1 tokens; the refit of the trainer's whole per-expert
    tensors keeps each rank's slices. Mutation: the MoE block's all-reduce dropped changes the tokens."""
    from test_moe_rollout import moe_policy
    from test_rollout_helpers import random_draft
    import specco.rollout.forward as fwd
    from specco.rollout.tp import tp_shard

    for family in ("qwen3_moe", "qwen2_moe"):
        policy = moe_policy(family).double()
        shard = tp_shard(policy, dist.group.WORLD)
        experts = shard.layers["0"].mlp.experts
        assert experts.gate_up_proj.shape == (6, 16, 32) and experts.down_proj.shape == (6, 32, 8)  # I 16 -> 8
        for dname, draft in (("plain", None), ("eagle3", random_draft(policy).double())):
            for cname, params in _cases().items():
                a, b = tokens(policy, draft, params), tokens(shard, draft, params)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (family, dname, cname, a, b)
        # mutation: the MoE block's partial sums not all-reduced (the attention's still are)
        real = fwd.reduce_partial
        fwd.reduce_partial = lambda x, group: x if x.dim() == 2 else real(x, group)  # the MoE block's rows are 2-D
        try:
            assert not torch.equal(tokens(policy, None, _cases()["greedy"])[0],
                                   tokens(shard, None, _cases()["greedy"])[0]), family
        finally:
            fwd.reduce_partial = real
        assert_refit_keeps_slices(shard, moe_policy(family, seed=5).double())  # refit: each rank keeps its slices


def test_engine_tp2_with_a_moe_target_decodes_the_tp1_tokens_and_refits():
    spawn_local(_moe_worker, 2)
