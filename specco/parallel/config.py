"""The device mesh's sizes as the run config writes them (`[parallel]`): its own dataclass, validated on
construction like every section of specco/config.py, which composes it."""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import check as _check


@dataclass(frozen=True)
class ParallelSpec:
    """The device mesh (parallel/mesh.py): pp × dp × cp × tp ranks, dp = dp_replicate × dp_shard.

    `dp` is the data-parallel degree: how many shares the step's prompts split into (the runner reads it). It
    factors as torchtitan's axes: dp_replicate ranks hold whole copies (their gradients all-reduced), dp_shard
    ranks hold FSDP shards of the policy (parallel/fsdp.py), and the FSDP axis is dp_shard × cp (CP ranks hold
    other tokens of the same sequences, so their gradients sum like data-parallel ones). Writing `dp` alone keeps
    its old meaning, pure replication (dp_replicate = dp, no sharding); setting `dp_shard` (to any size >= 1,
    1 shards over the cp ranks alone) turns FSDP on, HSDP when dp_replicate > 1 too. Unset sizes (0) are
    derived: dp = dp_replicate × dp_shard, or a missing factor = dp / the other. `replicate` / `shard` / `fsdp`
    are the resolved values; `dp_shard` and `dp_replicate` stay as written (0 = unset) so a run recorded before
    they existed resumes with the same config."""
    # the data-parallel degree, dp_replicate × dp_shard (0: their product; 1 when neither is set)
    dp: int = 0
    # FSDP: ranks sharing one copy of the policy, as shards (0: unset, no sharding unless dp_replicate and dp
    # are both given, which imply it)
    dp_shard: int = 0
    # ranks holding whole copies (HSDP's replicas under FSDP); 0: dp / dp_shard
    dp_replicate: int = 0
    cp: int = 1
    pp: int = 1
    # tensor parallelism of the trainer's policy (parallel/tp.py): its decoder layers' projections column / row
    # sharded over tp ranks, which hold the same tokens, and its head's vocabulary rows (loss-parallel); the draft
    # and the embedding stay whole on every rank. The innermost mesh axis; the world is pp × dp × cp × tp. The
    # rollout engine's degree is its own (rollout.tp)
    tp: int = 1
    # ... with sequence parallelism (parallel/tp.py): the residual stream and the norms cut along the sequence between
    # the blocks (activations / tp; micro-batch widths rounded up to a multiple of tp). Needs tp > 1; not with cp or pp
    tp_sequence_parallel: bool = False
    # expert parallelism of a mixture-of-experts policy's trainer (parallel/ep.py): each of ep ranks holds
    # num_experts / ep experts of every sparse layer, rows sent to their experts' ranks and back by all-to-all. Its
    # ranks are borrowed from the dp × cp ranks (which hold different tokens): ep divides dp × cp and num_experts, and
    # the world does not grow. With FSDP (dp_shard) the rest of the policy is sharded, the slices left to ep; under
    # pp each stage's experts over that stage's ranks. Not with tp yet
    ep: int = 1
    backend: str = "auto"  # auto -> nccl on CUDA, gloo on CPU
    # seconds any wait of the process group may last (a collective, its start-up) before the rank raises, so a rank
    # whose peer is stuck fails and torchrun --max-restarts can restart the job (parallel/mesh.py). The other ranks
    # wait in a collective while rank 0 runs SFT and the warm start alone: keep it above those stages' time
    timeout_s: float = 1800.0

    def __post_init__(self):
        _check(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
               and 0 < self.timeout_s < float("inf"), f"parallel.timeout_s={self.timeout_s!r}: must be a number of "
               "seconds > 0 (torch's default is 1800)")
        for n in ("cp", "pp", "tp", "ep"):
            _check(getattr(self, n) >= 1, f"parallel.{n}={getattr(self, n)}: must be >= 1")
        for n in ("dp", "dp_shard", "dp_replicate"):
            _check(getattr(self, n) >= 0, f"parallel.{n}={getattr(self, n)}: must be >= 1 (or 0: derived)")
        _check(self.backend in ("auto", "gloo", "nccl"), "parallel.backend: auto, gloo or nccl")
        _check(not self.tp_sequence_parallel or self.tp > 1, "parallel.tp_sequence_parallel=true needs "
               f"parallel.tp > 1 (it is {self.tp}): set parallel.tp or drop parallel.tp_sequence_parallel")
        dp, shard, rep = self.dp, self.dp_shard, self.dp_replicate
        if shard and rep:
            _check(not dp or dp == rep * shard,
                   f"parallel.dp={dp} but parallel.dp_replicate × parallel.dp_shard = {rep} × {shard} = {rep * shard}: "
                   f"dp is their product; drop parallel.dp (it is derived) or set it to {rep * shard}")
            dp = rep * shard
        elif dp and (shard or rep):
            given, name = (shard, "dp_shard") if shard else (rep, "dp_replicate")
            _check(dp % given == 0, f"parallel.dp={dp} is not a multiple of parallel.{name}={given} (dp = "
                   f"dp_replicate × dp_shard); set parallel.dp to a multiple of it, or drop parallel.dp")
        else:
            dp = dp or shard or rep or 1
        object.__setattr__(self, "dp", dp)  # the one derived value stored: the runner splits prompts by it

    @property
    def fsdp(self) -> bool:
        """Whether the policy is sharded (FSDP / HSDP): dp_shard was set, or implied by dp and dp_replicate."""
        return bool(self.dp_shard) or bool(self.dp_replicate and self.dp != self.dp_replicate)

    @property
    def shard(self) -> int:
        """The resolved dp_shard: ranks per copy of the policy along the data axis (1 without FSDP)."""
        return self.dp // self.replicate

    @property
    def replicate(self) -> int:
        """The resolved dp_replicate: whole copies (all of dp without FSDP)."""
        if self.dp_replicate:
            return self.dp_replicate
        return self.dp // self.dp_shard if self.dp_shard else self.dp
