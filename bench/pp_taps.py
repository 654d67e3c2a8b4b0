"""Pipeline co-training with the TapChannel against the alternatives (issue 13, docs/DESIGN.md §5).

One PP co-training step (1F1B over --pp stages, the draft on the last stage) timed per tap transport:

    channel    the TapChannel: its own group, R landing slots per source, stamps, credits (specco's)
    none       the same schedule with no draft (policy only)             } (a): none + draft_alone is the
    draft      the draft's compute alone on the last stage (its M micro-batches' TTT forward + backward on
               precomputed taps; no pipeline)                              } cost of co-training with free taps
    blocking   (b) taps with blocking send/recv on the schedule's own group, inside the schedule: a source
               sends them right after its activation, the last stage receives them right after the
               activation (sent inside the forward itself, before the activation, 1F1B deadlocks: gloo's
               send is a rendezvous — the failure docs/DESIGN.md §5 describes)
    host       (c) taps staged through host memory: serialised into a c10d FileStore by the source,
               read back (blocking get) by the last stage before each draft step

Reported: median step seconds over --steps (after --warmup), the channel's time waiting for taps as a
fraction of its step, the ratios channel / (none + draft), blocking / channel, host / channel, and the
time of gathering the whole policy from the stages (what the rollout engine's refit costs under PP).
Gloo processes on the CPU here; the same script takes --backend nccl on GPUs (torchrun) later.

    python bench/pp_taps.py --pp 2 --hidden 256 --layers 4 --rows 8 --seq 128 --micro-rows 2
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specco.model.config import DraftConfig, PolicyConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.policy import Policy, StageTaps  # noqa: E402
from specco.parallel.mesh import Mesh, spawn_local  # noqa: E402
from specco.parallel.pipeline import PipeComm, gather_stages, split_stage, stage_layer_ranges  # noqa: E402
from specco.parallel.taps import EMBED, TapChannel, TapSpec  # noqa: E402
from specco.train.cotrain import (StepConfig, TrainBatch, _TeacherOut, build_optimizer, cotrain_step,  # noqa: E402
                                  micro_batches, step_counts)
from specco.train.drafters import EAGLE3  # noqa: E402


class _Queued:
    """A tap transport with the channel's interface whose `post` only queues the taps; subclasses move
    them. `wait` returns what `_fetch` got for micro-batch m."""
    R = 1 << 30  # no slot limit

    def __init__(self, spec: TapSpec, stage: int, pp: int):
        self.spec, self.stage, self.pp, self.last = spec, stage, pp, pp - 1
        self.is_source = stage in spec.sources
        self.queue, self.got, self.wait_s = {}, {}, 0.0

    def begin(self, step, num_micro):
        self.step = step

    def post(self, m, taps):
        self.queue[m] = taps

    def end(self):
        assert not self.queue and not self.got, "taps left over"

    def _pack(self, taps):
        ids = self.spec.sources[self.stage]
        return torch.stack([taps.embed if i == EMBED else taps.layers[i] for i in ids])  # (n_ids, B, S, h)

    def _unpack(self, s, block):
        ids = self.spec.sources[s]
        return StageTaps(block[0] if ids[0] == EMBED else None, {i: block[k] for k, i in enumerate(ids) if i != EMBED})


class BlockingTaps(_Queued):
    """(b) Blocking send/recv on the pipeline group, riding the schedule's activation messages."""

    def __init__(self, spec, pipe: PipeComm):
        super().__init__(spec, pipe.stage, pipe.pp)
        self.pipe = pipe
        taps, orig_send, orig_recv = self, pipe.send_fwd, pipe.recv_fwd

        def send_fwd(act, m):  # after the activation: the taps, blocking, to the last stage
            orig_send(act, m)
            if m in taps.queue:
                dist.send(taps._pack(taps.queue.pop(m)).contiguous(), group=pipe.group, group_dst=taps.last, tag=7)

        def recv_fwd(shape, dtype, device, m):  # the last stage: every source's taps right after the activation
            x = orig_recv(shape, dtype, device, m)
            if taps.stage == taps.last:
                t0 = time.perf_counter()
                for s, ids in spec.sources.items():
                    buf = torch.empty(len(ids), *shape, dtype=spec.dtype, device=device)
                    dist.recv(buf, group=pipe.group, group_src=s, tag=7)
                    taps.got.setdefault(m, []).append(taps._unpack(s, buf))
                taps.wait_s += time.perf_counter() - t0
            return x

        pipe.send_fwd, pipe.recv_fwd = send_fwd, recv_fwd

    def wait(self, m, B, S):
        return self.got.pop(m)


class HostTaps(_Queued):
    """(c) Staged through host memory: torch.save bytes into a FileStore, read back by the last stage."""

    def __init__(self, spec, stage, pp, store):
        super().__init__(spec, stage, pp)
        self.store = store

    def post(self, m, taps):
        buf = io.BytesIO()
        torch.save(self._pack(taps).cpu(), buf)
        self.store.set(f"tap/{self.step}/{m}/{self.stage}", buf.getvalue())

    def wait(self, m, B, S):
        t0 = time.perf_counter()
        out = []
        for s in self.spec.sources:
            key = f"tap/{self.step}/{m}/{s}"
            block = torch.load(io.BytesIO(self.store.get(key)))
            self.store.delete_key(key)
            out.append(self._unpack(s, block))
        self.wait_s += time.perf_counter() - t0
        return out


def _setup(a):
    torch.manual_seed(0)
    pc = PolicyConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75),
                      num_layers=a.layers, num_heads=max(1, a.hidden // 64), num_kv_heads=max(1, a.hidden // 128))
    policy = Policy(pc)
    draft = Eagle3Draft(DraftConfig.for_policy(pc, min(a.vocab, 1024)))
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(a.rows, a.seq)
    mask[:, a.seq // 4:] = 1
    batch = TrainBatch(tokens=torch.randint(0, a.vocab, (a.rows, a.seq), generator=g), target_mask=mask,
                       advantages=torch.randn(a.rows, generator=g), logp_old=-torch.rand(a.rows, a.seq, generator=g))
    cfg = StepConfig(ttt_passes=a.passes, micro_batch_rows=a.micro_rows, draft_row_stride=1)
    return policy, draft, batch, cfg


def _worker(rank, world, a, store_path, out_path):
    mesh = Mesh.build(pp=world, backend="gloo")
    s, last = mesh.pp_rank, mesh.pp_rank == world - 1
    policy, draft0, batch, cfg = _setup(a)
    ranges = stage_layer_ranges(a.layers, world)
    aux = draft0.cfg.aux_layer_ids
    spec = TapSpec.for_stages(ranges, aux, a.hidden, torch.float32, a.micro_rows * a.seq)
    store = dist.FileStore(store_path, world)
    res = {}
    for mode in ("none", "channel", "blocking", "host"):
        stage = split_stage(policy, world, s)
        draft = copy.deepcopy(draft0) if (last and mode != "none") else None
        opt = build_optimizer(stage, draft, 1e-4, 1e-4)
        pipe = PipeComm(mesh.pp_group)
        taps = {"none": None, "channel": lambda: TapChannel(spec, mesh.tap_group, slots=world + a.extra_slots),
                "blocking": lambda: BlockingTaps(spec, pipe),
                "host": lambda: HostTaps(spec, s, world, store)}[mode]
        taps = taps() if taps else None
        times, waits = [], []
        for it in range(a.warmup + a.steps):
            w0 = taps.wait_s if taps is not None else 0.0
            dist.barrier()
            t0 = time.perf_counter()
            cotrain_step(stage, draft, batch, opt, None, cfg, pipe=pipe, taps=taps,
                            tap_layers=None if mode == "none" else aux, step=it)
            dist.barrier()
            if it >= a.warmup:
                times.append(time.perf_counter() - t0)
                waits.append((taps.wait_s if taps is not None else 0.0) - w0)
        times.sort()
        res[mode] = {"step_s": times[len(times) // 2], "tap_wait_s": sorted(waits)[len(waits) // 2]}
        if mode == "channel":  # the sources' waits for credits, per step (all stages' max)
            cw = torch.tensor([taps.credit_wait_s / (a.warmup + a.steps)])
            dist.all_reduce(cw, op=dist.ReduceOp.MAX)
            res[mode]["credit_wait_s"] = cw.item()
    # the refit's cost under PP: every rank gathers the whole policy from the stages (parallel.pipeline)
    stage = split_stage(policy, world, s)
    gt = []
    for it in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        full = gather_stages(stage, mesh.pp_group)
        gt.append(time.perf_counter() - t0)
    gt = sorted(gt[a.warmup:])
    res["gather"] = {"s": gt[len(gt) // 2], "bytes": sum(v.numel() * v.element_size() for v in full.values())}
    if last:  # (a)'s other half: the draft's compute alone, on taps computed here beforehand
        draft = copy.deepcopy(draft0)
        opt = build_optimizer(None, draft, 1e-4, 1e-4)
        counts = step_counts(batch, cfg)
        with torch.no_grad():
            outs = [(rows, mb, policy(mb.tokens, tap_layers=aux))
                    for rows, mb in micro_batches(batch, cfg.micro_batch_rows, cfg.draft_row_stride)]
        times = []
        for it in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            for rows, mb, o in outs:
                l_d, _ = EAGLE3.loss(draft, None, _TeacherOut(o.taps, o.logits), mb, cfg, counts.draft, rows=rows)
                (cfg.draft_weight * l_d).backward()
            opt.step()
            if it >= a.warmup:
                times.append(time.perf_counter() - t0)
        times.sort()
        res["draft"] = {"step_s": times[len(times) // 2]}
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-rows", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--extra-slots", type=int, default=1, help="TapChannel slots = pp + this (1: no source waits)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pp_taps_cpu.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res_path = os.path.join(tmp, "res.json")
        spawn_local(_worker, a.pp, a, os.path.join(tmp, "tapstore"), res_path)
        res = json.load(open(res_path))
    ch, none, dr = res["channel"]["step_s"], res["none"]["step_s"], res["draft"]["step_s"]
    summary = {
        "channel_over_a": ch / (none + dr), "blocking_over_channel": res["blocking"]["step_s"] / ch,
        "host_over_channel": res["host"]["step_s"] / ch, "tap_wait_frac_channel": res["channel"]["tap_wait_s"] / ch,
        "draft_overhead_over_policy_only": ch / none - 1, "gather_over_channel_step": res["gather"]["s"] / ch}
    doc = {"args": vars(a), "machine": f"{platform.machine()} {os.cpu_count()} cores, gloo", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "results": res, "summary": summary}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    from specco.parallel.mesh import run_worker  # noqa: E402
    run_worker(main)  # under torchrun: no interpreter teardown after success (its docstring)
