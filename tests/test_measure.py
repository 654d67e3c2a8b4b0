"""Measurement leaves the step (runner/measure.py, trainer.StepHooks).

* a co-trained arm with the plain baseline and the frozen shadow on trains exactly as with them off: the same
  weights, optimizer state and sampler state bit for bit (fp32 on the CPU, which is deterministic), and every
  metric the step logs the same but its timings; the measurements add exactly their own keys;
* a job (no `plain_baseline`, no `frozen_shadow`, a co-trained or no-draft arm) attaches no hook at all, and the
  comparison's arms get the hooks their config names.

On the CPU speculation control times its candidate k with the host clock, so its choices (hence tau, the
acceptance counts, the number of target forwards) vary from run to run; the test fixes the measured costs, so
that every metric but the seconds is a function of the tokens.
"""
from types import SimpleNamespace

import pytest
import torch

from specco.config_load import load_config
from specco.rollout.levels import Level
from specco.runner import measure
from specco.runner.derive import arm_config
from specco.runner.experiment import DEFAULT_ARMS
from specco.runner.rl import run_arm
from specco.runner.warmstart import new_draft
from test_grpo import DigitTask, _cfg, _setup
from cli_helpers import DEMO  # noqa: E402

# The keys the measurements add, and the step's keys that read the host clock (timings aside)
MEASURED = {"time/rollout_plain", "rollout/plain_speedup", "rollout/plain_rows_equal", "time/rollout_plain_phases",
            "time/train_plain", "time/shadow"}
CLOCKED = {"tokens_per_s", "rollout/measured_speedup"}

pytestmark = pytest.mark.e2e


def _fixed_costs(self, iters: int = 5):
    """Level.measure with costs that do not depend on the host: a round of k costs 1 + 0.2 k s (speculation pays
    while the draft is accepted)."""
    self.costs = {k: 1.0 + 0.2 * k for k in self.steps}
    return self.costs


def _state(st) -> dict:
    sd = {f"policy.{k}": v for k, v in st.policy.state_dict().items()}
    sd.update({f"draft.{k}": v for k, v in st.draft.state_dict().items()})
    sd.update({f"engine.{k}": v for k, v in st.engine.policy.state_dict().items()})
    for i, s in st.opt.state_dict()["state"].items():
        sd.update({f"opt.{i}.{k}": v for k, v in s.items() if torch.is_tensor(v)})
    sd["gen"] = st.gen.get_state()
    return sd


def test_measurement_leaves_the_step_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(Level, "measure", _fixed_costs)
    tok, policy = _setup()
    draft = new_draft(policy, torch.randint(0, tok.vocab_size, (4, 8)), aux_layer_ids=(0, 1))
    # three steps (an optimizer left advanced by the plain rerun shows from step 3 on), two epochs of two
    # minibatches (the log-prob recompute), a draft that moves, and the step's own skip snapshot beside the
    # baseline's copies
    common = ("train.steps=3", "rollout.sampler=coupled", "rollout.max_new_tokens=12", "rollout.spec_control=on",
              "arms=[cotrained]", "train.ppo_epochs=2", "train.minibatches=2", "train.draft_lr=1e-2",
              "train.on_nonfinite=skip")
    rows, states = {}, {}
    for name, extra in (("with", ("plain_baseline=[cotrained]", "frozen_shadow=[cotrained]")), ("without", ())):
        out = {}
        if name == "without":  # a job: no measurement hook is made, so none can be called
            for cls in (measure.PlainBaseline, measure.FrozenShadow, measure.FrozenDraftEval):
                for point in ("before_rollout", "after_rollout", "before_update", "after_update"):
                    monkeypatch.setattr(cls, point, lambda *a, **k: pytest.fail("a measurement hook ran"))
        rows[name] = run_arm(_cfg(tmp_path, *common, *extra), "cotrained", policy, draft, DigitTask(), tok,
                             tmp_path / name, progress=False, state_out=out)
        states[name] = _state(out["state"])
        assert [type(h) for h in out["hooks"]] == (
            [measure.PlainBaseline, measure.FrozenShadow] if name == "with" else [])
    assert states["with"].keys() == states["without"].keys()
    for k, v in states["without"].items():
        assert torch.equal(states["with"][k], v), k
    for a, b in zip(rows["with"], rows["without"], strict=True):
        added = a.keys() - b.keys()
        assert added == MEASURED | {k for k in a if k.startswith("shadow/")} and not b.keys() - a.keys()
        assert any(k.startswith("shadow/frozen/") for k in added) and a["rollout/plain_rows_equal"] == 1.0
        for k in b.keys() - CLOCKED:
            if not k.startswith("time/"):
                assert a[k] == b[k] or a[k] != a[k] and b[k] != b[k], (a["step"], k, a[k], b[k])
        assert a["tau"] > 1.0 and a["ppo/updates"] == 4  # it speculated, and ran every update


def test_a_job_has_no_measurement_hooks():
    """`specco train`'s default config and the demo job make no hook; `specco compare`'s arms get theirs:
    the frozen arm its draft metrics, the arms named in plain_baseline / frozen_shadow those."""
    def hooks(cfg, arm):
        acfg, mode = arm_config(cfg, arm)
        st = SimpleNamespace(arm=arm, mode=mode, pipeline=None, draft=torch.nn.Linear(1, 1))
        return [type(h).__name__ for h in measure.hooks_for(acfg, st, 0, "cpu")]
    for job in (load_config(), load_config(None, ["policy.source=tiny", "train.steps=3"])):  # `specco train`'s
        assert job.arms == ("cotrained",) and hooks(job, "cotrained") == []
    ab = load_config("configs/long_ab.toml")  # plain_baseline: both co-trained arms; frozen_shadow: both
    assert hooks(ab, "cotrained") == hooks(ab, "cotrained-dflash") == ["PlainBaseline", "FrozenShadow"]
    assert hooks(ab, "frozen") == ["FrozenDraftEval"]
    compared = load_config(DEMO)  # `specco demo`: the three arms, no plain baseline or shadow
    assert compared.arms == DEFAULT_ARMS and [hooks(compared, a) for a in DEFAULT_ARMS] == [[], ["FrozenDraftEval"], []]
