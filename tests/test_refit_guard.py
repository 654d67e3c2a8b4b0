"""The refit guard: a refit that leaves the engine with stale weights, or an acceptance collapse after
a weight sync, stops the run with an error naming the step and what was compared — and a healthy run
is silent (the RL tests run with the guard on, its default)."""
import pytest
import torch

from specco.rollout.engine import RefitError, RolloutEngine, weights_fingerprint
from specco.rollout.weights import InPlaceLoad
from specco.runner.refit_guard import check_acceptance
from test_rollout_helpers import random_draft, tiny_policy
from cli_helpers import DEMO  # noqa: E402

pytestmark = pytest.mark.e2e


def test_fingerprint_sees_a_changed_or_permuted_tensor():
    policy = tiny_policy()
    sd = {k: v.clone() for k, v in policy.state_dict().items()}
    assert torch.equal(weights_fingerprint(sd), weights_fingerprint(policy.state_dict()))
    w = sd["layers.0.mlp.down_proj.weight"]
    w.view(-1)[[3, 4]] = w.view(-1)[[4, 3]]  # a swap of two elements: same sum and norm
    assert not torch.equal(weights_fingerprint(sd), weights_fingerprint(policy.state_dict()))


def test_check_weights_names_the_stale_tensor(monkeypatch):
    policy, draft = tiny_policy(), random_draft(tiny_policy())
    engine = RolloutEngine(tiny_policy(seed=3), random_draft(tiny_policy(), seed=4))
    engine.refit(policy.state_dict(), draft.state_dict())
    engine.check_weights(policy.state_dict(), draft.state_dict(), step=1)  # healthy: silent
    # a broken refit that writes the draft's old fc weight back (the silent failure peers report; a tensor that
    # never arrives is the refit's own RefitError: test_refit_stream.py)
    real = InPlaceLoad.write
    monkeypatch.setattr(InPlaceLoad, "write", lambda self, bucket: real(self, [
        (k, self.own[k].clone() if (self.what, k) == ("draft", "fc.weight") else v) for k, v in bucket]))
    new_draft = random_draft(tiny_policy(), seed=9)
    engine.refit(None, new_draft.state_dict())
    with pytest.raises(RefitError, match=r"step 7.*draft.*fc\.weight"):
        engine.check_weights(policy.state_dict(), new_draft.state_dict(), step=7)


def test_acceptance_collapse_rule():
    check_acceptance([0.6, 0.55], 0.5, 500, 3)  # a normal drift: silent
    check_acceptance([0.01, 0.02], 0.0, 500, 3)  # never accepted much: nothing collapsed
    check_acceptance([0.6, 0.6], 0.0, 10, 3)  # too few proposals to judge
    with pytest.raises(RefitError, match="step 3: .*collapsed to 0.000 over 500 proposals, after 0.60"):
        check_acceptance([0.6, 0.6], 0.0, 500, 3)
    with pytest.raises(RefitError, match="step 4: .*pinned at exactly 1.0"):
        check_acceptance([0.6, 0.55], 1.0, 500, 4)


def _run_cfg(tmp_path, tiny_start, *extra):
    """Two co-trained RL steps of the session's SFT'd tiny policy and warm draft (conftest.tiny_start)."""
    from specco.config_load import load_config
    return load_config(DEMO, [f"out_dir={tmp_path}", "arms=cotrained", "train.steps=2", *tiny_start.overrides(),
                              "train.warm_start_prompts=8", "rollout.prompts_per_step=4", "rollout.group_size=2",
                              "rollout.max_new_tokens=6", "data.eval_size=4", *extra])


def test_rl_loop_stops_on_a_broken_draft_refit(tmp_path, monkeypatch, tiny_start):
    """Two co-trained RL steps where the engine's refit silently keeps its old draft: the guard raises at
    step 1, naming it."""
    from specco.runner.pipeline import run as run_demo
    cfg = _run_cfg(tmp_path, tiny_start)
    real = RolloutEngine.refit_buckets  # consumes the draft's stream (fingerprinted) but writes none of it
    monkeypatch.setattr(RolloutEngine, "refit_buckets",
                        lambda self, p, d=None: (d is not None and list(d), real(self, p, None))[1])
    with pytest.raises(RefitError, match="after the refit of step 1: the engine's draft weights differ"):
        run_demo(cfg, progress=False)


def test_a_bf16_engine_holds_the_trainers_weights_as_refit_cast_them(monkeypatch):
    """rollout.dtype: an engine in bf16 refit from fp32 trainer weights passes the guard (the fingerprint
    casts the trainer's tensors as refit does), generates exactly what the bf16-rounded policy does, and a
    refit that leaves one tensor stale is still caught, though the change is far below fp32 noise."""
    from specco.rollout.generate import GenerateConfig, generate
    from specco.rollout.sampling import SamplingParams
    policy, draft = tiny_policy(), random_draft(tiny_policy())
    engine = RolloutEngine(tiny_policy(seed=3).to(torch.bfloat16), random_draft(tiny_policy(), seed=4).to(torch.bfloat16),
                           GenerateConfig(max_new_tokens=8, sampling=SamplingParams(temperature=0.0)))
    engine.refit(policy.state_dict(), draft.state_dict())
    assert all(p.dtype == torch.bfloat16 for p in engine.policy.parameters())
    engine.check_weights(policy.state_dict(), draft.state_dict(), step=1)  # healthy: silent
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    rounded = tiny_policy().to(torch.bfloat16)  # the trainer's weights rounded to bf16
    assert torch.equal(engine.generate(prompts).tokens, generate(rounded, prompts, engine.cfg).tokens)
    # the trainer takes a step whose change survives bf16 rounding in one tensor only; refit drops it
    new = {k: v.clone() for k, v in policy.state_dict().items()}
    new["layers.1.mlp.up_proj.weight"] *= 1.01
    real = InPlaceLoad.write
    monkeypatch.setattr(InPlaceLoad, "write", lambda self, bucket: real(self, [
        (k, self.own[k].clone() if k == "layers.1.mlp.up_proj.weight" else v) for k, v in bucket]))
    engine.refit(new)
    with pytest.raises(RefitError, match=r"step 2.*policy.*up_proj"):
        engine.check_weights(new, None, step=2)


def test_rollout_dtype_is_checked():
    from specco.config_load import load_config
    from specco.model.config import ConfigError
    with pytest.raises(ConfigError, match="rollout.dtype='bf16'"):
        load_config(DEMO, ["rollout.dtype=bf16"])
    assert load_config(DEMO, ["rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"
    # in every layout: the log-probs and the saved policy come from the trainer (derive.on_device)
    assert load_config(DEMO, ["rollout.dtype=bfloat16", "parallel.pp=2"]).rollout.dtype == "bfloat16"


def test_rl_loop_with_a_bf16_engine(tmp_path, monkeypatch, tiny_start):
    """rollout.dtype=bfloat16 end to end: the engine's copies are bf16, every refit casts into them and the
    guard (weights and acceptance) stays silent over two co-trained steps."""
    from specco.runner import trainer
    from specco.runner.pipeline import run as run_demo
    built = []
    real = trainer.RolloutEngine
    monkeypatch.setattr(trainer, "RolloutEngine", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    cfg = _run_cfg(tmp_path, tiny_start, "rollout.dtype=bfloat16")
    run_demo(cfg, progress=False)
    (engine,) = built
    assert {p.dtype for m in (engine.policy, engine.draft) for p in m.parameters()} == {torch.bfloat16}
    assert (tmp_path / "summary.json").exists()
