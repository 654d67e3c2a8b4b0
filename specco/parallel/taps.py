"""The TapChannel: taps from the pipeline stages to the draft on the last stage, off the schedule's path.

docs/DESIGN.md §5. The draft lives whole on the last stage; the embedding tap comes from stage 0 and each aux
tap from the stage holding that layer. Sending them with blocking send/recv inside the schedule shares
ordering with its activation traffic (and can deadlock against it), so the channel has its own process
group (the mesh's `tap_group`: the same ranks as the pp group, a different communicator) and its own
flow control:

    last stage, per source stage s:  a mailbox of R landing slots (header + payload, sized by `TapSpec`)
    begin(step, M)   the last stage pre-posts the receives of micro-batches 0 .. min(R, M) - 1
    post(m, taps)    source s: wait for slot m mod R's credit (m >= R), copy its detached taps into its
                     staging buffer, isend header + payload — it never waits for the draft to compute
    wait(m, B, S)    last stage: wait (with a timeout) for slot m mod R from every source, check the stamp
                     (step, micro-batch, source, layer ids, B, S), copy the taps out, re-post the slot's
                     receive for micro-batch m + R and return the credit to the source
    end()            everything posted was consumed; no send, receive or credit is in flight

"One-sided" with torch.distributed only means exactly that: receives pre-posted into the slots, sends
posted by the source on the channel's group, the credit a re-posted receive plus a small message telling
the source so. A source never overwrites an unconsumed slot: it sends micro-batch m into slot j only
after the credit of micro-batch m - R (the slot's previous occupant) came back, and the last stage gives
that credit only after copying the slot out. Taps are copied (detached): no gradient crosses.

The ring of one step does not outlive it (begin ... end): micro-batch indices restart every step, and no
receive stays posted between steps, so the process group can be torn down cleanly at any step boundary.
Slots and 1F1B: a source posts micro-batch m in its forward F(m), which in 1F1B comes after its backward of
m - pp, i.e. after the last stage's backward of m - pp; the last stage runs F(k), B(k), draft(k) in turn.
So the credit of m - R has come back when R >= pp + 1 (draft(m - pp - 1) finished before B(m - pp)
began): sources never wait. R = pp cannot deadlock, but a post then waits for the draft's work on
m - pp whenever that outlasts the source's own backward of m - pp (on 2 CPU cores, bench/pp_taps.py
measured 0.1 ms per step of credit waits at R = pp); R < pp can deadlock (the warmup forwards need
credits that only come after the pipe is full). `credit_wait_s` records the time a source waited.

Failure is loud: a wait past `timeout_s` raises `TapTimeout` naming the source stage, the micro-batch,
the step and the layers; a stamp or shape that does not match raises `TapMismatch` — the draft never
trains on stale or misrouted taps.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model.policy import StageTaps

__all__ = ["EMBED", "TapSpec", "TapChannel", "TapTimeout", "TapMismatch"]

EMBED = -1  # the embedding tap's id in stamps (stage 0 sends it before its aux layers)
_HDR = 6  # header: step, micro-batch, source, B, S, number of tensors; then the ids


class TapTimeout(RuntimeError):
    pass


class TapMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class TapSpec:
    """What lands in the mailbox: per source stage the ids it sends (EMBED first, then its aux layers
    ascending), the hidden size, dtype and the most tokens (B·S) of one micro-batch; a slot holds
    len(ids) · max_tokens · hidden_size elements."""
    sources: dict[int, tuple[int, ...]]
    hidden_size: int
    dtype: torch.dtype
    max_tokens: int

    @classmethod
    def for_stages(cls, ranges: list[range], aux_layer_ids, hidden_size: int, dtype, max_tokens: int) -> "TapSpec":
        """The spec of a pipeline split into `ranges` (stage_layer_ranges): every stage but the last that
        holds the embedding (stage 0) or a tap layer is a source; the last stage's own taps stay local."""
        sources = {}
        for s, r in enumerate(ranges[:-1]):
            ids = ((EMBED,) if s == 0 else ()) + tuple(i for i in sorted(aux_layer_ids) if i in r)
            if ids:
                sources[s] = ids
        return cls(sources, hidden_size, dtype, max_tokens)

    def slot_numel(self, source: int) -> int:
        return len(self.sources[source]) * self.max_tokens * self.hidden_size


def _layers(ids) -> str:
    return ", ".join("embedding" if i == EMBED else f"layer {i}" for i in ids)


class TapChannel:
    """One rank's end of the channel over `group` (group rank = pipeline stage; the last rank is the
    draft's stage). Sources call begin/post/end, the last stage begin/wait/end; others only begin/end."""

    def __init__(self, spec: TapSpec, group, slots: int = 2, timeout_s: float = 60.0):
        if slots < 1:
            raise ValueError(f"TapChannel slots={slots}: must be >= 1")
        self.spec, self.group, self.R, self.timeout_s = spec, group, slots, timeout_s
        self.stage, self.pp = dist.get_rank(group), dist.get_world_size(group)
        self.last = self.pp - 1
        if self.last in spec.sources:
            raise ValueError("the last stage's own taps are local; it cannot be a source of the channel")
        self.is_source = self.stage in spec.sources
        nid = max((len(i) for i in spec.sources.values()), default=0)
        self._hdr_len = _HDR + nid
        buf = lambda s: (torch.zeros(self._hdr_len, dtype=torch.int64),  # noqa: E731
                         torch.empty(spec.slot_numel(s), dtype=spec.dtype))
        # Landing slots (last stage: per source) or staging buffers (a source), R of each, from setup on.
        if self.stage == self.last:
            self.mailbox = {s: [buf(s) for _ in range(slots)] for s in spec.sources}
        elif self.is_source:
            self.staging = [buf(self.stage) for _ in range(slots)]
        self.step, self.num_micro = None, 0
        self.wait_s = 0.0  # time the last stage spent blocked in `wait` (bench: the tap wait)
        self.credit_wait_s = 0.0  # time this source spent waiting for credits (0 with slots >= pp + 1)

    # tags on the channel's own group (matched per peer): header / payload of slot j, credit of slot j
    def _tags(self, j):
        return 3 * j, 3 * j + 1, 3 * j + 2

    def begin(self, step: int, num_micro: int) -> None:
        """Open step `step` of `num_micro` micro-batches: the last stage pre-posts its receives."""
        assert self.step is None, f"TapChannel.begin(step={step}) while step {self.step} is still open"
        self.step, self.num_micro, self.next_m = step, num_micro, 0
        self._recvs: dict[tuple[int, int], list] = {}  # (source, m) -> [header work, payload work]
        self._sends: list = []  # (work, buffer) of taps (sources) or credits (last stage)
        self._credits: dict[int, object] = {}  # a source: m -> credit receive work for micro-batch m
        if self.stage == self.last:
            for s in self.spec.sources:
                for m in range(min(self.R, num_micro)):
                    self._post_recv(s, m)

    def _post_recv(self, s, m):
        j = m % self.R
        hdr, payload = self.mailbox[s][j]
        th, tp, _ = self._tags(j)
        self._recvs[(s, m)] = [dist.irecv(hdr, group=self.group, group_src=s, tag=th),
                               dist.irecv(payload, group=self.group, group_src=s, tag=tp)]

    def _deadline_wait(self, works, what: str) -> None:
        """Wait for `works` within timeout_s in all, or raise TapTimeout(what). `Work.wait(timeout)` is the
        primitive: gloo's `is_completed` does not advance a receive, so polling it would never finish. A
        timed-out gloo receive closes the channel's connection: the error is fatal for the channel (the
        schedule's and the other groups' connections are separate and stay usable)."""
        t_end = time.monotonic() + self.timeout_s
        for w in works:
            left = max(t_end - time.monotonic(), 1e-3)
            try:
                w.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                if "imed out" not in str(e) and "imeout" not in str(e):
                    raise
                raise TapTimeout(f"{what}: nothing arrived within {self.timeout_s:g} s (step {self.step})") from e

    def _wait_sends(self, which) -> None:
        """Wait for (and forget) the sends whose buffer satisfies `which` (a gloo work is waited once)."""
        keep = []
        for w, buf in self._sends:
            if which(buf):
                w.wait()
            else:
                keep.append((w, buf))
        self._sends = keep

    # -- source side ---------------------------------------------------------------------------------
    def post(self, m: int, taps: StageTaps) -> None:
        """Send micro-batch m's taps of this stage (detached copies) into slot m mod R of the mailbox."""
        ids = self.spec.sources[self.stage]
        assert m == self.next_m, f"stage {self.stage}: posting micro-batch {m}, expected {self.next_m}"
        j = m % self.R
        if m >= self.R:  # the slot's previous occupant (m - R) must have been consumed: its credit
            t0 = time.perf_counter()
            self._deadline_wait([self._credits.pop(m - self.R)[0]],
                                f"tap channel: source stage {self.stage} waiting for the last stage's credit of "
                                f"micro-batch {m - self.R} (slot {j}; {_layers(ids)})")
            self.credit_wait_s += time.perf_counter() - t0
        tensors = [taps.embed if i == EMBED else taps.layers.get(i) for i in ids]
        if any(t is None for t in tensors) or (taps.embed is not None and EMBED not in ids) or \
                sorted(taps.layers) != [i for i in ids if i != EMBED]:
            raise TapMismatch(f"stage {self.stage} posts taps {sorted(taps.layers)} (embedding: "
                              f"{taps.embed is not None}) but the TapSpec says it sends {_layers(ids)}")
        B, S, h = tensors[0].shape
        n = len(ids) * B * S * h
        if h != self.spec.hidden_size or n > self.spec.slot_numel(self.stage):
            raise TapMismatch(f"stage {self.stage}, micro-batch {m}: taps of shape {(B, S, h)} do not fit a slot "
                              f"(TapSpec: hidden {self.spec.hidden_size}, max_tokens {self.spec.max_tokens})")
        hdr, payload = self.staging[j]
        self._wait_sends(lambda buf: buf is hdr or buf is payload)  # the slot's previous sends (long done)
        hdr[:_HDR] = torch.tensor([self.step, m, self.stage, B, S, len(ids)])
        hdr[_HDR:_HDR + len(ids)] = torch.tensor(ids)
        payload[:n].view(len(ids), B, S, h).copy_(torch.stack([t.detach() for t in tensors]))  # (n_ids, B, S, h)
        th, tp, tc = self._tags(j)
        self._sends += [(dist.isend(hdr, group=self.group, group_dst=self.last, tag=th), hdr),
                        (dist.isend(payload, group=self.group, group_dst=self.last, tag=tp), payload)]
        if m + self.R < self.num_micro:  # slot j is used again this step: expect its credit
            credit = torch.empty(2, dtype=torch.int64)
            self._credits[m] = (dist.irecv(credit, group=self.group, group_src=self.last, tag=tc), credit)
        self.next_m += 1

    # -- last stage ----------------------------------------------------------------------------------
    def wait(self, m: int, B: int, S: int) -> list[StageTaps]:
        """Micro-batch m's taps from every source (ascending stage), once they landed and their stamps
        match (step, m, source, layer ids, B, S). Copies them out, then frees the slots (credits)."""
        assert self.stage == self.last, "only the last stage consumes taps"
        assert m == self.next_m, f"consuming micro-batch {m}, expected {self.next_m} (taps are consumed in order)"
        t0 = time.perf_counter()
        out = []
        for s, ids in self.spec.sources.items():
            j = m % self.R
            self._deadline_wait(self._recvs.pop((s, m)), f"tap channel: the last stage got no taps from source stage "
                                f"{s} for micro-batch {m} ({_layers(ids)}; slot {j})")
            hdr, payload = self.mailbox[s][j]
            want = [self.step, m, s, B, S, len(ids), *ids]
            got = hdr[:len(want)].tolist()
            if got != want:
                raise TapMismatch(f"tap channel: slot {j} of source stage {s} holds stamp (step, micro-batch, source, "
                                  f"B, S, n, ids...) = {got}, expected {want}: refusing to train on stale or "
                                  f"misrouted taps")
            h = self.spec.hidden_size
            block = payload[:len(ids) * B * S * h].view(len(ids), B, S, h).clone()  # (n_ids, B, S, h)
            out.append(StageTaps(block[0] if ids[0] == EMBED else None,
                                 {i: block[k] for k, i in enumerate(ids) if i != EMBED}))
            # The slot is copied out: re-post its receive (for m + R) and give the source its credit.
            if m + self.R < self.num_micro:
                self._post_recv(s, m + self.R)
                credit = torch.tensor([self.step, m], dtype=torch.int64)
                self._sends.append((dist.isend(credit, group=self.group, group_dst=s, tag=self._tags(j)[2]), credit))
        self.next_m += 1
        self.wait_s += time.perf_counter() - t0
        return out

    def end(self) -> None:
        """Close the step: wait for our sends; assert that no tap, receive or credit is outstanding."""
        if self.step is None:
            return
        done = self.next_m if (self.is_source or self.stage == self.last) else self.num_micro
        if self.spec.sources and done != self.num_micro:
            raise RuntimeError(f"tap channel, stage {self.stage}: step {self.step} ends after {done} of "
                               f"{self.num_micro} micro-batches")
        self._wait_sends(lambda buf: True)
        assert not self._recvs, f"last stage: tap receives {sorted(self._recvs)} still posted at the end of the step"
        assert not self._credits, f"stage {self.stage}: credits {sorted(self._credits)} never came back"
        self._sends, self.step = [], None
