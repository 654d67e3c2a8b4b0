"""The streamed refit (runner/refit.py -> RolloutEngine.refit_buckets) and rollout.offload (RolloutEngine.release /
restore), on one process. Exact: every comparison is bit for bit (torch.equal), because the streamed refit does
the same elementwise copies (and fp32 -> bf16 casts, round to nearest even) as the whole-state refit, only grouped
differently, and offload only frees and refills storages.

* a streamed refit into a bf16 engine equals the whole-state refit at every bucket bound, the smallest (1 byte:
  each tensor alone, the bound smaller than any tensor) included, and no bucket exceeds max(bound, its tensor);
* a tensor missing from, repeated in, or foreign to the stream is a RefitError naming it, after the whole stream
  was consumed (under FSDP every rank must take part in every gather);
* the guard (fingerprints taken as the stream passes) is silent on a healthy refit and names a corrupted
  engine weight and a tensor the engine lacks;
* offload: weights+cache (dropped policy, frozen draft kept on the host) and cache, then restore -> refit ->
  rollout gives the tokens of the same engine without offload; decoding or refitting in between is refused.
"""
import pytest
import torch

from specco.rollout.engine import RefitError, RolloutEngine
from specco.rollout.generate import GenerateConfig
from specco.rollout.sampling import SamplingParams
from specco.runner.refit import refit_engine, state_buckets
from test_rollout_helpers import random_draft, tiny_policy

BOUNDS = [1, 3000, 20000, 2 ** 30]  # bytes: every tensor alone; a few per bucket; most of the model; one bucket
CFG = GenerateConfig(max_new_tokens=8, num_draft_tokens=2, sampling=SamplingParams(temperature=1.0))
PROMPTS = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([7, 8, 9, 10])]


def _engine(dtype=torch.bfloat16):
    return RolloutEngine(tiny_policy(seed=3, tie=True).to(dtype), random_draft(tiny_policy(), seed=4).to(dtype), CFG)


def _trainer():
    policy = tiny_policy(seed=5, tie=True)
    return policy, random_draft(policy, seed=6)


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("bound", BOUNDS)
def test_streamed_refit_equals_the_whole_state_refit(bound):
    policy, draft = _trainer()
    whole, streamed = _engine(), _engine()
    whole.refit(policy.state_dict(), draft.state_dict())
    ptrs = streamed._storage_fingerprint()
    rows = refit_engine(streamed, policy.state_dict(), draft.state_dict(), bound, guard=True)
    _same_state(whole.policy, streamed.policy)
    _same_state(whole.draft, streamed.draft)
    assert streamed._storage_fingerprint() == ptrs  # in place: the captured graphs' addresses stay
    streamed.check_fingerprints(rows["policy"], rows["draft"], step=1)  # healthy: silent
    whole.check_weights(policy.state_dict(), draft.state_dict(), step=1)  # and it agrees with the whole-state guard


def test_buckets_are_bounded():
    policy, _ = _trainer()
    dtypes = {k: torch.bfloat16 for k in policy.state_dict()}
    for bound in BOUNDS:
        buckets = list(state_buckets(policy.state_dict(), bound, dtypes))
        names = [k for b in buckets for k, _ in b]
        assert names == list(policy.state_dict())  # every tensor once, in order
        for b in buckets:
            assert all(v is policy.state_dict()[k] or v.data_ptr() == policy.state_dict()[k].data_ptr()
                       for k, v in b)  # a whole tensor travels as it is (the engine's copy_ casts)
            size = sum(v.numel() * 2 for _, v in b)  # counted in the engine's dtype
            assert size <= bound or len(b) == 1, (bound, [k for k, _ in b])
    assert len(list(state_buckets(policy.state_dict(), 1, dtypes))) == len(policy.state_dict())


def test_a_missing_repeated_or_foreign_tensor_is_named():
    policy, _ = _trainer()
    engine = _engine()
    items = list(policy.state_dict().items())
    consumed = []

    def stream(pairs):  # one tensor per bucket; records how far the engine read
        for p in pairs:
            consumed.append(p[0])
            yield [p]

    with pytest.raises(RefitError, match=r"missing \['norm.weight'\]"):
        engine.refit_buckets(stream([p for p in items if p[0] != "norm.weight"]))
    assert len(consumed) == len(items) - 1  # read to the end before raising
    with pytest.raises(RefitError, match=r"sent more than once \['norm.weight'\]"):
        engine.refit_buckets(stream(items + [("norm.weight", policy.norm.weight)]))
    with pytest.raises(RefitError, match=r"unexpected \['extra'\]"):
        engine.refit_buckets(stream(items + [("extra", torch.zeros(1))]))
    with pytest.raises(RefitError, match="shape mismatch.*norm.weight"):
        engine.refit_buckets(stream([(k, torch.ones(7) if k == "norm.weight" else v) for k, v in items]))


def test_the_guard_catches_a_corrupted_weight_and_a_missing_tensor():
    policy, draft = _trainer()
    engine = _engine()
    rows = refit_engine(engine, policy.state_dict(), draft.state_dict(), 3000, guard=True)
    engine.check_fingerprints(rows["policy"], rows["draft"], step=3)
    with torch.no_grad():  # one element of one engine tensor changes by one bf16 ulp after the refit
        w = engine.policy.layers["2"].mlp.down_proj.weight
        w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(1e9, dtype=w.dtype))
    with pytest.raises(RefitError, match=r"step 3.*policy weights differ.*1 tensor.*layers.2.mlp.down_proj"):
        engine.check_fingerprints(rows["policy"], rows["draft"], step=3)
    rows["draft"]["extra"] = rows["draft"]["fc.weight"]  # the trainer has a tensor the engine's draft lacks
    with pytest.raises(RefitError, match=r"draft has other tensors.*missing \['extra'\]"):
        engine.check_fingerprints(None, rows["draft"], step=3)


def _rollout(engine, seed=0):
    return engine.generate(PROMPTS, group_size=2, generator=torch.Generator().manual_seed(seed)).tokens


@pytest.mark.parametrize("mode", ["cache", "weights+cache"])
def test_offload_then_refit_gives_the_tokens_without_offload(mode):
    """Step: rollout -> release -> (the trainer runs) -> restore -> streamed refit of the policy only (the draft is
    frozen, so under weights+cache it waits on the host) -> rollout; against the same engine never released."""
    policy, _ = _trainer()
    plain, off = _engine(), _engine()
    assert torch.equal(_rollout(plain), _rollout(off))
    weights = mode == "weights+cache"
    freed = off.release(weights=weights, refilled=("policy",))
    model_bytes = sum(t.untyped_storage().nbytes() for m in (plain.policy, plain.draft)
                      for t in {t.untyped_storage().data_ptr(): t for t in (*m.parameters(), *m.buffers())}.values())
    assert freed >= off.cached_bytes() + (model_bytes if weights else 0) and freed > 0
    if weights:
        assert all(p.untyped_storage().nbytes() == 0 for p in off.policy.parameters())  # the memory is gone
        with pytest.raises(RefitError, match="released.*not restored"):
            _rollout(off)
        with pytest.raises(RefitError, match="restore"):
            off.refit(policy.state_dict())
        off.restore()
        with pytest.raises(RefitError, match=r"not refit: \['policy'\]"):
            _rollout(off)
    else:
        off.restore()  # nothing to restore: a no-op
    for engine in (plain, off):
        rows = refit_engine(engine, policy.state_dict(), None, 3000, guard=True,
                            guard_draft=engine.draft.state_dict())
        engine.check_fingerprints(rows["policy"], rows["draft"], step=1)
    _same_state(plain.policy, off.policy)
    _same_state(plain.draft, off.draft)  # the frozen draft came back from the host
    assert torch.equal(_rollout(plain, 1), _rollout(off, 1))
    assert off.release(weights=weights, refilled=("policy",)) > 0  # and again, the next step
    off.restore()
    refit_engine(off, policy.state_dict(), None, 3000, guard=False)
    assert torch.equal(_rollout(plain, 2), _rollout(off, 2))


def test_the_guard_refuses_an_engine_released_and_never_refit():
    engine = _engine()
    rows = {"policy": engine.fingerprints("policy")}
    engine.release(weights=True, refilled=("policy", "draft"))
    engine.restore()
    with pytest.raises(RefitError, match=r"\['draft', 'policy'\] weights were released.*no refit"):
        engine.check_fingerprints(rows["policy"], None, step=4)


def test_config_keys_are_checked():
    from cli_helpers import DEMO
    from specco.config_load import load_config
    from specco.model.config import ConfigError
    cfg = load_config(DEMO, [])
    assert cfg.rollout.refit_bucket_mb == 512 and cfg.rollout.offload == "none"
    with pytest.raises(ConfigError, match="rollout.refit_bucket_mb=0"):
        load_config(DEMO, ["rollout.refit_bucket_mb=0"])
    with pytest.raises(ConfigError, match=r"rollout.offload='sleep'.*'weights\+cache'"):
        load_config(DEMO, ["rollout.offload=sleep"])
    with pytest.raises(ConfigError, match=r"rollout.offload='weights\+cache' with parallel.pp=2"):
        load_config(DEMO, ["rollout.offload=weights+cache", "parallel.pp=2"])
    assert load_config(DEMO, ["rollout.offload=cache", "parallel.pp=2"]).rollout.offload == "cache"


@pytest.mark.e2e
@pytest.mark.parametrize("arm", ["cotrained", "frozen"])
def test_rl_loop_with_offload_equals_without(tmp_path, arm):
    """Two RL steps of the demo's fp64 models (tests/test_rl_cp.py's) with rollout.offload=weights+cache and a
    small refit bucket: the same rollouts (tokens), losses and final weights as the default run, bit for bit, and
    the freed memory logged. The frozen arm's draft is kept on the host across the updates, the co-trained one's
    dropped and refit."""
    from test_grpo import DigitTask
    from test_rl_cp import _cfg, _models
    from specco.runner.rl import run_arm
    tok, policy, draft = _models()
    runs = {}
    for name, extra in (("plain", ()), ("offload", ("rollout.offload=weights+cache", "rollout.refit_bucket_mb=1"))):
        st, rec = {}, []
        rows = run_arm(_cfg(tmp_path, "train.steps=2", "rollout.prompts_per_step=4", *extra), arm, policy, draft,
                       DigitTask(), tok, tmp_path / name, progress=False, state_out=st, record=rec)
        runs[name] = rows, st["state"], rec
    (rows0, st0, rec0), (rows1, st1, rec1) = runs["plain"], runs["offload"]
    assert [r.pairs for r in rec0] == [r.pairs for r in rec1]
    for a, b in zip(rows0, rows1):
        assert a["policy/loss"] == b["policy/loss"] and a["tau"] == b["tau"]
        assert b["mem/offload_freed_gib"] * 2 ** 30 >= sum(p.numel() * 8 for p in policy.parameters())
    for m0, m1 in ((st0.engine.policy, st1.engine.policy), (st0.engine.draft, st1.engine.draft)):
        _same_state(m0, m1)
