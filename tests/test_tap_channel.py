"""The TapChannel on gloo (docs/DESIGN.md §5): taps land equal to the unsplit model's, in micro-batch order, with
more micro-batches than slots; a slow consumer never sees a slot overwritten; a silent source makes the
last stage raise the named error within the timeout; a wrong stamp raises. Stages come from
`split_stage`; the reference is the unsplit Policy's own `taps` (fp64; the stage forwards run the same
ops on the same inputs, so equality is exact: atol = rtol = 0).
"""
import time

import pytest
import torch
import torch.distributed as dist

from specco.model.config import PolicyConfig
from specco.model.policy import Policy, StageTaps, join_taps
from specco.parallel.mesh import spawn_local
from specco.parallel.pipeline import split_stage, stage_layer_ranges
from specco.parallel.taps import TapChannel, TapMismatch, TapSpec, TapTimeout

PC = PolicyConfig(vocab_size=41, hidden_size=16, intermediate_size=24, num_layers=5, num_heads=2, num_kv_heads=1)
AUX = (0, 2, 4)

pytestmark = pytest.mark.dist


def test_stage_ranges_and_split_equal_the_unsplit_model():
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    with pytest.raises(ValueError, match="every stage holds a layer"):
        stage_layer_ranges(3, 4)
    torch.manual_seed(0)
    full = Policy(PC).double()
    tok = torch.randint(0, PC.vocab_size, (2, 7))
    ref = full(tok, tap_layers=AUX)
    x, parts = None, []
    for s in range(3):
        st = split_stage(full, 3, s)
        o = st(tok if s == 0 else None, hidden_in=x, tap_layers=AUX)
        x = o.hidden
        parts.append(o.stage_taps)
    torch.testing.assert_close(o.logits, ref.logits, atol=0, rtol=0)
    assert parts[1].embed is None and parts[2].embed is None  # no fake embedding tap on later stages
    joined = join_taps(parts, AUX, PC.hidden_size)
    torch.testing.assert_close(joined.aux, ref.taps.aux, atol=0, rtol=0)
    torch.testing.assert_close(joined.embed, ref.taps.embed, atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing \\[4\\]"):
        join_taps(parts[:2], AUX, PC.hidden_size)
    with pytest.raises(ValueError, match="reported by two stages"):
        join_taps(parts + [StageTaps(None, dict(parts[1].layers))], AUX, PC.hidden_size)
    with pytest.raises(ValueError, match="expected"):
        bad = StageTaps(None, {4: parts[2].layers[4][:, :3]})
        join_taps(parts[:2] + [bad], AUX, PC.hidden_size)


def _micro(m):
    return torch.randint(0, PC.vocab_size, (2, 4 + m % 3), generator=torch.Generator().manual_seed(m))  # varied S


def _arrival_worker(rank, world, M, R, consumer_delay_s):
    pp = world
    torch.manual_seed(0)
    full = Policy(PC).double()
    ranges = stage_layer_ranges(PC.num_layers, pp)
    stages = [split_stage(full, pp, s) for s in range(pp)]
    group = dist.new_group(list(range(world)))  # the channel's own communicator
    spec = TapSpec.for_stages(ranges, AUX, PC.hidden_size, torch.float64, max_tokens=2 * 6)
    ch = TapChannel(spec, group, slots=R, timeout_s=30)
    for step in (3, 4):  # two steps: the ring opens and closes per step
        ch.begin(step, M)
        for m in range(M):
            tok = _micro(m)
            x = None
            for s in range(rank + 1):  # this rank's stage input, computed locally (no schedule here)
                o = stages[s](tok if s == 0 else None, hidden_in=x, tap_layers=AUX)
                x = o.hidden
            if rank < pp - 1:
                if rank in spec.sources:
                    ch.post(m, o.stage_taps)
                continue
            time.sleep(consumer_delay_s)  # a slow consumer: sources run ahead until the credits stop them
            taps = join_taps(ch.wait(m, *tok.shape) + [o.stage_taps], AUX, PC.hidden_size)
            ref = full(tok, tap_layers=AUX).taps
            torch.testing.assert_close(taps.aux, ref.aux, atol=0, rtol=0)
            torch.testing.assert_close(taps.embed, ref.embed, atol=0, rtol=0)
        ch.end()


@pytest.mark.parametrize("pp", [2, 3])
def test_taps_arrive_equal_and_in_order_with_more_micro_batches_than_slots(pp):
    spawn_local(_arrival_worker, pp, 7, 2, 0.0)


def test_slow_consumer_never_sees_a_slot_overwritten():
    # R = 1: every post after the first waits for the previous credit; with a 50 ms consumer the sources
    # would overwrite the slot many times over without flow control (the stamps and values would not match).
    spawn_local(_arrival_worker, 2, 5, 1, 0.05)


def _silent_worker(rank, world, timeout_s, out):
    group = dist.new_group([0, 1])
    spec = TapSpec.for_stages([range(0, 1), range(1, 2)], (0,), 4, torch.float32, max_tokens=6)
    ch = TapChannel(spec, group, slots=2, timeout_s=timeout_s)
    ch.begin(5, 4)
    taps = StageTaps(torch.ones(1, 3, 4), {0: torch.ones(1, 3, 4)})
    if rank == 0:
        ch.post(0, taps)  # then the source goes silent
    else:
        ch.wait(0, 1, 3)
        t0 = time.monotonic()
        with pytest.raises(TapTimeout) as e:
            ch.wait(1, 1, 3)
        elapsed = time.monotonic() - t0
        msg = str(e.value)
        assert "source stage 0" in msg and "micro-batch 1" in msg and "step 5" in msg and "layer 0" in msg, msg
        assert timeout_s <= elapsed < timeout_s + 2.0, elapsed
    dist.barrier()


def test_silent_source_raises_named_timeout():
    spawn_local(_silent_worker, 2, 0.5, None)


def _stamp_worker(rank, world):
    group = dist.new_group([0, 1])
    spec = TapSpec.for_stages([range(0, 1), range(1, 2)], (0,), 4, torch.float32, max_tokens=6)
    ch = TapChannel(spec, group, slots=2, timeout_s=30)
    ch.begin(7 if rank == 0 else 8, 1)  # the source is a step behind
    if rank == 0:
        ch.post(0, StageTaps(torch.ones(1, 3, 4), {0: torch.ones(1, 3, 4)}))
        ch.end()
    else:
        with pytest.raises(TapMismatch, match="refusing to train on stale"):
            ch.wait(0, 1, 3)
    dist.barrier()


def test_stale_stamp_raises():
    spawn_local(_stamp_worker, 2)
