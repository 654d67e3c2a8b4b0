"""The refit's trainer side: the policy (+ draft) streamed to the rollout engine in bounded buckets, fingerprinted
for the refit guard as it passes, with no whole state dict held (docs/DESIGN.md §9, REVIEW item 6).

    rows = refit_engine(engine, st.policy.state_dict(), draft_sd, bucket_bytes, guard=True, guard_draft=...)
    engine.check_fingerprints(rows["policy"], rows["draft"], step=...)      the refit guard, later in the step

`state_buckets` walks a state dict in its own order and yields lists of (name, whole tensor) whose whole bytes,
in the engine's dtype, are at most `bucket_bytes` — or one tensor alone where it is larger than the bound, so the
peak extra memory of a refit is max(bucket, largest tensor). Under FSDP (parallel.dp_shard) a bucket's DTensor
shards are cast to the engine's dtype *then* gathered (`full_tensor()`, a collective: every rank walks the same
keys in the same order), so a bf16 engine's refit moves and holds half the bytes of the fp32 masters; the cast is
elementwise round-to-nearest-even, bit for bit what the engine's `copy_` would have done. A plain tensor (one
process, DP, the stages PP gathered) passes as it is, no copy: the engine's `copy_` casts it. The engine writes each
bucket in place and empties it (rollout/weights.InPlaceLoad), so its whole tensors are freed before the next
gather.

The guard's fingerprint of each tensor is taken here, from the tensor the engine receives, as it streams past
(weights.tensor_fingerprint, a (3,) row per tensor kept on the device); the engine later fingerprints its own
copy and the two must be equal. What the stream cannot see: a frozen draft is never refit, so `guard_draft`
fingerprints the trainer's whole (replicated) draft directly.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor

from ..rollout.engine import RolloutEngine
from ..rollout.tp import local_part
from ..parallel.ep import expert_stream, is_ep
from ..rollout.weights import fingerprint_rows, tensor_fingerprint
from .rl_pp import gather_for_refit

__all__ = ["state_buckets", "refit_engine"]

MB = 2 ** 20


def _whole(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """t whole: a DTensor's shards cast to `dtype`, then gathered (a collective); a plain tensor as it is (no copy:
    the engine's copy_ casts it on the way in, and a cast here would allocate what the bucket bound counts)."""
    t = t.detach()
    if not isinstance(t, DTensor):
        return t
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # each rank casts its own shard (local, pointwise)
    return t.full_tensor()


def state_buckets(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  dtypes: Mapping[str, torch.dtype] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (name, whole tensor) covering `state` once, in its order (module docstring). `state`: a state
    dict, or its (name, tensor) pairs as a stream (parallel/ep.expert_stream: an expert-parallel policy's experts
    gathered a layer at a time as the walk reaches them). dtypes: the engine's dtype per name
    (RolloutEngine.dtypes), for the cast before the gather and for the byte count."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in (state.items() if isinstance(state, Mapping) else state):
        dtype = dtypes.get(name) if dtypes is not None else None
        nbytes = t.numel() * (dtype or t.dtype).itemsize  # a DTensor's numel is the whole tensor's
        if pending and size + nbytes > bucket_bytes:
            yield [(k, _whole(v, d)) for k, v, d in pending]
            pending, size = [], 0
        pending.append((name, t, dtype))
        size += nbytes
    if pending:
        yield [(k, _whole(v, d)) for k, v, d in pending]


def _fingerprinted(stream, rows: dict, dtypes: Mapping[str, torch.dtype] | None, model) -> Iterator[list]:
    """The stream unchanged; each tensor's guard row recorded in `rows` on its way to the engine, as the engine's
    `model` will hold it: cast to its dtype (a no-op for a gathered shard, cast already) and, for a tensor-parallel
    engine (rollout.tp), this rank's slice (rollout/tp.local_part)."""
    for bucket in stream:
        for name, t in bucket:
            rows[name] = tensor_fingerprint(local_part(model, name, t), dtypes.get(name) if dtypes is not None else None)
        yield bucket


def refit_engine(engine: RolloutEngine, policy: Mapping[str, torch.Tensor] | Iterable | None,
                 draft: Mapping[str, torch.Tensor] | None, bucket_bytes: int, guard: bool,
                 guard_draft: Mapping[str, torch.Tensor] | None = None) -> dict:
    """Stream `policy` and `draft` (state dicts of the trainer's modules: DTensor shards or whole tensors; None
    keeps the engine's) into `engine` in buckets of at most `bucket_bytes` (module docstring). With `guard`,
    returns the trainer-side fingerprints {"policy": rows | None, "draft": rows | None} for
    RolloutEngine.check_fingerprints; `guard_draft`: a draft that is not refit (frozen) but must match the
    engine's all the same. Without `guard`, returns {} and fingerprints nothing."""
    rows: dict = {"policy": {} if policy is not None else None, "draft": {} if draft is not None else None}
    streams = {}
    for name, state in (("policy", policy), ("draft", draft)):
        if state is None:
            streams[name] = None
            continue
        dtypes = engine.dtypes(name) if name == "policy" or engine.draft is not None else None
        stream = state_buckets(state, bucket_bytes, dtypes)
        model = engine.policy if name == "policy" else engine.draft
        streams[name] = _fingerprinted(stream, rows[name], dtypes, model) if guard else stream
    engine.refit_buckets(streams["policy"], streams["draft"])
    if not guard:
        return {}
    if draft is None and guard_draft is not None:
        rows["draft"] = fingerprint_rows(guard_draft, engine.dtypes("draft") if engine.draft is not None else None)
    return rows


def refit_arm(st, cfg, mesh, fingerprint: bool = False) -> tuple[dict, float]:
    """The engine refilled from the trainer's weights, the one home of that (every RL step; arm_checkpoint after a
    resume): under PP the stages streamed over the pipeline group bucket by bucket (and the last stage's draft),
    otherwise the policy's state dict (under FSDP DTensor shards, gathered bucket by bucket as they stream: a
    collective, every rank), in rollout.refit_bucket_mb buckets. A released engine (rollout.offload) is restored
    first. Returns (the guard's fingerprints, refit_engine's; under PP the seconds of the whole streamed gather and
    write, 0 without PP). A draft that is not refit (frozen) is still fingerprinted for the guard's comparison with
    the engine's."""
    t0 = time.perf_counter()
    frozen_draft = st.draft.state_dict() if st.draft is not None and st.mode != "cotrained" else None
    if st.pipeline is not None:
        policy_sd, draft_sd = gather_for_refit(st, mesh, bucket_bytes=cfg.rollout.refit_bucket_mb * MB)
    else:  # expert parallelism: the engine holds every expert, gathered over the ep group (a collective) a layer
        # at a time as the buckets stream (parallel/ep.expert_stream)
        policy_sd = expert_stream(st.policy) if is_ep(st.policy) else st.policy.state_dict()
        draft_sd = st.draft.state_dict() if st.mode == "cotrained" else None
    st.engine.restore()  # rollout.offload: the released storages allocated again, for the refit to fill
    guard = refit_engine(st.engine, policy_sd, draft_sd, cfg.rollout.refit_bucket_mb * MB, fingerprint, frozen_draft)
    return guard, time.perf_counter() - t0 if st.pipeline is not None else 0.0
