"""How new weights enter the rollout engine, how the refit guard fingerprints them, and how the engine's weights
are released between rollouts (rollout.offload).

    load = InPlaceLoad(model, "policy")          one model's refit
    for bucket in buckets: load.write(bucket)    (name, whole tensor) pairs, in any grouping and order
    n = load.finish()                            RefitError unless every tensor arrived exactly once
    rows = fingerprint_rows(state)               {name: (3,) fp64 row}: what the refit guard compares
    held = ReleasedWeights.release(models, ...); held.restore()   weights freed between rollouts, then back

Writes are in place: each tensor is `copy_`'d into the engine's existing parameter (casting to its dtype), never
assigned, so the addresses captured CUDA graphs read stay valid and tied weights stay tied. The trainer side
(runner/refit.py) streams the tensors in bounded buckets; this module never needs a whole state dict.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from .tp import local_part


class RefitError(RuntimeError):
    """New weights could not be loaded into the rollout engine exactly."""


def _head(keys, n: int = 8) -> str:
    keys = sorted(keys)
    return f"{keys[:n]}{'...' if len(keys) > n else ''}"


class InPlaceLoad:
    """One model's refit from a stream of (name, tensor) pairs. A boundary (STYLE §10): a name the model does not
    have, a name sent twice, a shape mismatch or a name never sent is a RefitError naming them — raised by
    `finish`, after the whole stream was consumed, so that under FSDP every rank still takes part in every
    bucket's gather (one rank raising mid-stream would leave the others waiting in a collective)."""

    def __init__(self, model: nn.Module, what: str):
        self.what = what
        self.model = model
        self.own = model.state_dict()  # views of the parameters (the fused projections' parts too): no copy
        # a tensor-parallel engine shard (rollout/tp.py) takes whole tensors and keeps its rank's slice of the cut ones
        self.slices = getattr(model, "tp_slices", {})
        self.tp_size = getattr(model, "tp_size", 1)
        self.seen: set[str] = set()
        self.unexpected: list[str] = []
        self.repeated: list[str] = []
        self.bad_shape: list[tuple] = []

    @torch.no_grad()
    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Copy a bucket's tensors into the model, then empty the bucket: the caller's list is the stream's, so
        its whole tensors are freed before the next bucket is gathered (runner/refit.py)."""
        for name, tensor in bucket:
            dst = self.own.get(name)
            if dst is None:
                self.unexpected.append(name)
            elif name in self.seen:
                self.repeated.append(name)
            elif (dim := self.slices.get(name)) is not None and tensor.shape[dim] != dst.shape[dim] * self.tp_size:
                self.bad_shape.append((name, tuple(tensor.shape), f"{tuple(dst.shape)} x {self.tp_size} along {dim}"))
            elif tuple(local_part(self.model, name, tensor).shape) != tuple(dst.shape):
                self.bad_shape.append((name, tuple(tensor.shape), tuple(dst.shape)))
            else:  # in place, cast to the engine's dtype (round to nearest even)
                dst.copy_(local_part(self.model, name, tensor))
                self.seen.add(name)
        bucket.clear()

    def finish(self) -> int:
        """The number of tensors written; RefitError unless each of the model's tensors arrived exactly once."""
        missing = set(self.own) - self.seen - {n for n, _, _ in self.bad_shape}
        if self.bad_shape:
            raise RefitError(f"{self.what} refit: shape mismatch (key, given, expected): {self.bad_shape[:8]}")
        if missing or self.unexpected or self.repeated:
            raise RefitError(f"{self.what} refit: state keys do not match the engine's model; missing "
                             f"{_head(missing)}, unexpected {_head(self.unexpected)}, sent more than once "
                             f"{_head(set(self.repeated))}")
        return len(self.seen)


def tensor_fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(3,) fp64 on t's device: the sum, the L2 norm and the neighbour products Σ x_i x_{i+1} of one tensor (so
    moved elements show too). dtype: cast first, as refit's copy_ does (round to nearest even) — the trainer's
    fp32 weights as a bf16 engine holds them. bf16/fp16 are upcast to fp32 (exactly): neighbour products in bf16
    would round small changes away. Equal tensors on one device give bitwise-equal rows (the same reductions over
    the same values and layouts); a guard against stale weights, not a cryptographic hash."""
    flat = t.detach().reshape(-1)
    if dtype is not None:
        flat = flat.to(dtype)
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.float()
    if not flat.is_floating_point():  # small integer / bool buffers (vocabulary maps)
        flat = flat.double()
    neighbours = torch.dot(flat[:-1], flat[1:]).double() if flat.numel() > 1 else flat.sum().double()
    return torch.stack([flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, dtype=torch.float64),
                        neighbours])


def fingerprint_rows(state: Mapping[str, torch.Tensor],
                     dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """{name: tensor_fingerprint} of a state dict, one tensor at a time (no copy of an fp32/fp64 tensor)."""
    return {k: tensor_fingerprint(v, dtypes.get(k) if dtypes is not None else None) for k, v in state.items()}


def weights_fingerprint(state: Mapping[str, torch.Tensor],
                        dtypes: Mapping[str, torch.dtype] | None = None) -> torch.Tensor:
    """(n_tensors, 3) fp64 on the host: `fingerprint_rows` stacked in sorted key order."""
    rows = fingerprint_rows(state, dtypes)
    return torch.stack([rows[k] for k in sorted(rows)]).cpu()


def compare_fingerprints(name: str, mine: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor],
                         where: str) -> None:
    """RefitError unless the engine's rows (`mine`) equal the trainer's (`theirs`) key for key."""
    if set(mine) != set(theirs):
        raise RefitError(f"{where}: the engine's {name} has other tensors than the trainer's "
                         f"(missing {_head(set(theirs) - set(mine), 5)}, extra {_head(set(mine) - set(theirs), 5)})")
    keys = sorted(mine)
    a = torch.stack([mine[k] for k in keys]).cpu()  # one device-to-host copy per model, not one per tensor
    b = torch.stack([theirs[k].to(a.device) for k in keys]).cpu()
    if not torch.equal(a, b):
        bad = [k for k, x, y in zip(keys, a, b) if not torch.equal(x, y)]
        raise RefitError(f"{where}: the engine's {name} weights differ from the trainer's in {len(bad)} tensor(s), "
                         f"e.g. {bad[:5]} (fingerprints compared: sum, norm, neighbour products per tensor) — the "
                         "new weights did not reach the rollout engine")


def _as_bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A storage as a flat uint8 tensor over the same bytes (copies between devices go through tensors)."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,))


class ReleasedWeights:
    """The engine's parameter and buffer storages, freed between rollouts (rollout.offload=weights+cache).

    Each distinct storage is `resize_(0)`'d: the Parameter objects stay (module structure, tied weights, the
    state-dict views of the fused projections), only their bytes go. A model the next refit fills whole
    (`refilled`) is dropped outright, nothing copied; every other storage (a frozen draft, a buffer outside the
    state dict such as the rotary tables) is copied to the host first (pinned on CUDA) and copied back by
    `restore`. `restore` allocates again: the addresses change, so captured CUDA graphs are invalid and the engine
    drops its runners (re-captured at the next rollout). PyTorch's caching allocator cannot promise the old
    address back; vLLM's sleep mode keeps it by reserving virtual addresses (cuMemMap), which torch does not expose.
    """

    def __init__(self, entries: list, awaiting: set[str], nbytes: int):
        self.entries = entries  # (storage, nbytes, host copy or None)
        self.awaiting = awaiting  # models whose weights are garbage until their next refit
        self.nbytes = nbytes  # device bytes freed

    @classmethod
    def release(cls, models: Mapping[str, nn.Module], refilled: Iterable[str]) -> "ReleasedWeights":
        refilled = {n for n in refilled if n in models}
        dropped = {t.untyped_storage().data_ptr() for n in refilled for t in models[n].state_dict().values()}
        entries, done, total = [], set(), 0
        for m in models.values():
            for t in (*m.parameters(), *m.buffers()):
                s = t.untyped_storage()
                if s.data_ptr() in done or s.nbytes() == 0:
                    continue
                done.add(s.data_ptr())
                host = None
                if s.data_ptr() not in dropped:
                    host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=s.device.type == "cuda")
                    host.copy_(_as_bytes(s))
                entries.append((s, s.nbytes(), host))
                total += s.nbytes()
                s.resize_(0)
        return cls(entries, refilled, total)

    def restore(self) -> None:
        """Allocate every storage again (uninitialised where the refit fills it) and copy the host copies back."""
        for s, n, host in self.entries:
            s.resize_(n)
            if host is not None:
                _as_bytes(s).copy_(host)
        self.entries = []
