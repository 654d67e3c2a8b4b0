"""The named (pp, dp, cp, tp) device mesh, built once (STYLE §3: groups are arguments, this is where they come from).

`torch.distributed.device_mesh.init_device_mesh` lays the ranks out row-major over (pp, dp_replicate,
dp_shard, cp, tp), with dp = dp_replicate · dp_shard (config.ParallelSpec) and dp_rank = replicate_rank · dp_shard
+ shard_rank, so that

    global rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

as it was before the data axis was split (and tp added, innermost): at tp = 1 every group below has the same
members for a given dp as before. Tensor parallelism is innermost, as in torchtitan and Megatron: its two
all-reduces per layer in each direction are the heaviest traffic of all, so a TP group's ranks are adjacent (one
node's NVLink). Every group below except tp_group holds ranks of ONE tp rank: the tp ranks of a group hold the same
tokens and the same replicated weights, so counts, metrics and replicated gradients are summed over the other axes
only (a sum over tp would count every token tp times).

so the ranks of one CP group are contiguous — on GPU nodes they share NVLink, which the ring's per-step
K/V traffic wants; DP traffic (one gradient all-reduce per step) tolerates the slower links; pipeline
stages are the outermost dimension (they may sit on different nodes: only activations cross them).

    cp_group    ranks with the same (pp, dp, tp)    ring attention, CP shift, sharing a DP group's rollouts
    dp_group    ranks with the same (pp, cp, tp)    metrics of the DP replicas
    pp_group    ranks with the same (dp, cp, tp)    the pipeline schedule's point-to-point traffic
    grad_group  the dp × cp ranks of one stage      gradient sums and loss counts (CP ranks hold disjoint tokens)
                and one tp rank
    tp_group    ranks with the same (pp, dp, cp)    tensor parallelism (parallel/tp.py, via tp_mesh); sharing rollouts
    tap_group   the same ranks as pp_group, its OWN communicator: the tap channel (docs/DESIGN.md §5) must never
                share ordering with the schedule's traffic. None when pp = 1 (no channel).
    fsdp_mesh   the DeviceMesh `parallel.fsdp.apply_fsdp` shards the policy over: 1-D (fsdp,) = the
                dp_shard × cp ranks of one (pp, replica) when dp_replicate = 1, else 2-D (dp_replicate, fsdp) for
                HSDP (shards reduce-scattered along fsdp, then all-reduced along dp_replicate). Its ranks are
                grad_group's, so an FSDP reduction sums over exactly the ranks the losses' counts cover. Under
                tensor parallelism FSDP2 composes it with the parameters' own tp mesh (2-D (fsdp, tp) DTensors).
    tp_mesh     the 1-D (tp,) DeviceMesh `parallel.tp.apply_tp` shards the policy's layers over.
    ep_group    expert parallelism (parallel/ep.py): consecutive runs of ep of the stage's dp × cp ranks (cp innermost),
                which hold different tokens, so ep adds no ranks; None when ep = 1
    ep_replica_group  the ranks holding the same expert slice (the same position in their ep group): expert
                gradients are summed over it; None when ep = 1 or ep = dp × cp (a slice on one rank only)
    rollout_tp_group  the rollout engine's tp group (rollout.tp ranks, rollout/tp.py): the ranks of one (pp, dp)
                that share a DP group's rollouts, cp x tp of them in rank order, cut into consecutive runs of
                rollout_tp; None when rollout_tp = 1. Its ranks decode together, so they are adjacent too.

The flattened axes (dp, the stage's dp × cp) come from DeviceMesh's `_flatten` / `_unflatten` (private,
torchtitan uses them too); this is the one file that calls them. The flattened meshes are kept here rather
than sliced from the root again (torch deprecates slicing a flattened dim from the root).

Also `spawn_local`: run a function on N local gloo processes (tests, CPU benches), each with the
process group initialised through a file store (no ports to collide).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Mesh", "init_distributed", "spawn_local", "launched_world", "run_worker", "DEFAULT_TIMEOUT_S"]

# torch's own default for a process group (30 min); the run's value is config.ParallelSpec.timeout_s
DEFAULT_TIMEOUT_S = 1800.0


def launched_world() -> int:
    """How many processes torchrun launched (WORLD_SIZE; 1 without torchrun): the one place the launch is read."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _exit_without_teardown() -> None:
    """End a process whose work succeeded, outputs flushed, without the interpreter's teardown. There the process
    groups' C++ background threads are destroyed still joinable now and then ("terminate called without an active
    exception", SIGABRT): a run whose every output was written and collectives done failed at exit (CI runs of
    tests/test_ep_job.py and of spawned gloo tests, 2026-12-05 and -07). A failure never comes here: it raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(main) -> None:
    """Run `main()` as a program's entry point; a torchrun worker (launched_world() > 1) whose main returned or
    exited 0 then ends by _exit_without_teardown. Errors and non-zero exits propagate as before. Used by the
    `specco` command and the bench scripts that torchrun launches (spawn_local's workers end the same way)."""
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    if launched_world() > 1:
        _exit_without_teardown()


def init_distributed(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Initialise the default process group from torchrun's environment (idempotent).

    backend 'auto' -> nccl when CUDA is available, gloo otherwise. Returns the backend used. `timeout_s` bounds
    every wait of this group (the store, a collective): a rank whose peer is stuck raises after it instead of
    blocking, so torchrun can stop the job and restart it (parallel.timeout_s).

    Under torchrun the group rendezvouses in a namespace of its own per restart (`_attempt_store`): torch's
    agent keeps one TCPStore for the whole job, and without it a restarted worker reads the keys the previous
    attempt's workers left there (their gloo addresses) and connects to a dead process ("Connection refused",
    or a hang in init_process_group).
    """
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = _attempt_store(timeout)
        if store is None:  # not under torchrun: env:// as torch reads it
            dist.init_process_group(backend, timeout=timeout)
        else:
            try:
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            except RuntimeError as e:  # DistStoreError (a peer never came) is one
                raise RuntimeError(
                    f"rank {rank}: the process group of torchrun attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} "
                    f"did not form within parallel.timeout_s={timeout_s:g} s ({e}). Every rank of an attempt must "
                    "start it; a re-rendezvous of an elastic --nnodes MIN:MAX job is not supported (use a fixed "
                    "--nnodes N)") from e
    return backend


def _attempt_store(timeout: timedelta):
    """(store, rank, world) for this torchrun attempt: the job's store (MASTER_ADDR:MASTER_PORT, built as torch's
    env:// does: a client of the agent's store, or hosted by rank 0) seen through the prefix
    "specco-attempt<TORCHELASTIC_RESTART_COUNT>/", so the keys of an attempt whose workers were killed are
    never read again. (None, 0, 0) outside torchrun.

    Every worker of an attempt must agree on the count: torch's agents count a restart after a failure (every
    node's, when a rank's death fails its peers' collectives), not a re-rendezvous for a node joining an elastic
    job (--nnodes MIN:MAX); there the attempts' prefixes differ, the init times out after parallel.timeout_s,
    and the error says so."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None, 0, 0
    from torch.distributed.rendezvous import rendezvous
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"specco-attempt{attempt}/", store), rank, world


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int  # dp_replicate × dp_shard: the data-parallel degree
    cp: int
    rank: int
    backend: str
    device_mesh: DeviceMesh  # (pp, dp_replicate, dp_shard, cp, tp)
    cp_group: object
    dp_group: object
    pp_group: object
    grad_group: object
    tap_group: object | None
    dp_shard: int = 1
    dp_mesh: DeviceMesh | None = None  # (dp,): dp_replicate × dp_shard flattened
    fsdp_mesh: DeviceMesh | None = None  # (fsdp,) or (dp_replicate, fsdp): see the module docstring
    tp: int = 1
    tp_group: object | None = None
    tp_mesh: DeviceMesh | None = None  # (tp,)
    rollout_tp: int = 1
    rollout_tp_group: object | None = None
    ep: int = 1
    ep_group: object | None = None
    ep_replica_group: object | None = None

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.device_mesh.get_local_rank("cp")

    @property
    def tp_rank(self) -> int:
        return self.device_mesh.get_local_rank("tp")

    @property
    def rollout_tp_index(self) -> int:
        """Which engine tp group of its DP group's cp x tp ranks this rank is in (0: the one that generates)."""
        return (self.cp_rank * self.tp + self.tp_rank) // self.rollout_tp

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @classmethod
    def build(cls, dp: int = 1, cp: int = 1, backend: str = "auto", pp: int = 1, dp_shard: int = 1,
              timeout_s: float = DEFAULT_TIMEOUT_S, tp: int = 1, rollout_tp: int = 1, ep: int = 1) -> "Mesh":
        """Create the mesh and every group (collective: all ranks call it, once). Sizes that do not
        multiply to the job's WORLD_SIZE are an error naming the launch that would fit. `dp` is the whole
        data-parallel degree and `dp_shard` its FSDP factor (config.ParallelSpec's `dp` and `shard`):
        dp_replicate = dp / dp_shard. `timeout_s`: how long any wait of the group may last (init_distributed).
        `tp`: the tensor-parallel degree (config.ParallelSpec's `tp`), the innermost axis; `rollout_tp`: the
        engine's (config.RolloutSpec's `tp`), a divisor of cp × tp. `ep`: expert parallelism (config.ParallelSpec's
        `ep`), borrowed from each stage's dp × cp ranks: a divisor of dp × cp, with tp = 1 (not wired with tp)."""
        for name, n in (("pp", pp), ("dp", dp), ("cp", cp), ("dp_shard", dp_shard), ("tp", tp)):
            if n < 1:
                raise ValueError(f"parallel.{name}={n}: must be >= 1")
        if rollout_tp < 1 or (cp * tp) % rollout_tp:
            raise ValueError(f"rollout.tp={rollout_tp} must divide parallel.cp × parallel.tp = {cp * tp}")
        if dp % dp_shard:
            raise ValueError(f"parallel.dp={dp} is not a multiple of parallel.dp_shard={dp_shard} "
                             "(dp = dp_replicate × dp_shard)")
        if ep < 1 or (dp * cp) % ep:
            raise ValueError(f"parallel.ep={ep} must divide parallel.dp × parallel.cp = {dp * cp} "
                             "(ep borrows those ranks)")
        if ep > 1 and tp > 1:
            raise ValueError(f"parallel.ep={ep} with parallel.tp={tp}: expert parallelism is not wired with tensor "
                             "parallelism; use parallel.tp=1")
        rep = dp // dp_shard
        backend = init_distributed(backend, timeout_s)
        world, rank = dist.get_world_size(), dist.get_rank()
        if pp * dp * cp * tp != world:
            n = pp * dp * cp * tp
            raise ValueError(f"parallel.pp × parallel.dp × parallel.cp × parallel.tp = {pp} × {dp} × {cp} × {tp} = "
                             f"{n} but the job has {world} processes; launch {n} in all (torchrun --nproc-per-node "
                             f"× --nnodes), or change the sizes")
        dm = init_device_mesh("cuda" if backend == "nccl" else "cpu", (pp, rep, dp_shard, cp, tp),
                              mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        dp_mesh = dm["dp_replicate", "dp_shard"]._flatten("dp")  # (dp,) replicate-major: dp_rank = r · dp_shard + s
        stage = dm["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")  # (dp · cp,): one stage's ranks
        fsdp_mesh = stage._unflatten(0, (rep, dp_shard * cp), ("dp_replicate", "fsdp"))  # (rep, dp_shard · cp)
        if rep == 1:  # plain FSDP: a 2-D mesh would make FSDP all-reduce over a group of one
            fsdp_mesh = fsdp_mesh["fsdp"]
        grid = dm.mesh.reshape(pp, dp, cp, tp)  # global ranks; (rep, dp_shard) -> dp row-major, as dp_mesh
        # one stage's dp × cp ranks of one tp rank: the whole world only without pp and tp
        grad_group = dist.group.WORLD if pp == tp == 1 else stage.get_group() if pp == 1 else None
        tap_group = None
        if pp > 1:  # new_group is collective: every rank creates every group, in the same order
            me = (dm.get_local_rank("pp"), dp_mesh.get_local_rank(), dm.get_local_rank("cp"), dm.get_local_rank("tp"))
            for s in range(pp):
                for t in range(tp):
                    g = dist.new_group(grid[s, :, :, t].flatten().tolist())
                    if (me[0], me[3]) == (s, t):
                        grad_group = g
            for d in range(dp):
                for c in range(cp):
                    for t in range(tp):
                        g = dist.new_group(grid[:, d, c, t].tolist())
                        if me[1:] == (d, c, t):
                            tap_group = g
        rollout_group = None
        if rollout_tp > 1:  # consecutive runs of the (cp, tp) block of each (pp, dp): every rank creates every group
            for block in grid.reshape(pp * dp, cp * tp).tolist():
                for i in range(0, cp * tp, rollout_tp):
                    g = dist.new_group(block[i:i + rollout_tp])
                    if rank in block[i:i + rollout_tp]:
                        rollout_group = g
        ep_group = ep_replica = None
        if ep > 1:  # tp = 1: each stage's dp × cp ranks in mesh order (cp innermost); every rank creates every
            # stage's groups (new_group is collective) and keeps its own stage's
            from .ep import ep_groups
            for s in range(pp):
                groups = ep_groups(grid[s, :, :, 0].flatten().tolist(), ep, rank)
                if s == dm.get_local_rank("pp"):
                    ep_group, ep_replica = groups
        return cls(pp, dp, cp, rank, backend, dm, dm["cp"].get_group(), dp_mesh.get_group(), dm["pp"].get_group(),
                   grad_group, tap_group, dp_shard, dp_mesh, fsdp_mesh, tp, dm["tp"].get_group(), dm["tp"],
                   rollout_tp, rollout_group, ep, ep_group, ep_replica)


def _spawn_entry(rank, world, store_path, fn, args):
    # A worker killed by a signal leaves no Python traceback (torch.multiprocessing reports only the signal): the
    # fault handler prints every thread's stack to stderr first (a CI run, 2026-12-05: a SIGSEGV in one rank of
    # tests/test_ep_fsdp.py's RL loop, not reproduced in 6 reruns)
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # N processes on a few cores: avoid oversubscription
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank is done with the groups before any tears them down
    finally:
        dist.destroy_process_group()
    # a failing worker raised above instead, and torch.multiprocessing.spawn reports its traceback
    _exit_without_teardown()


# What a local worker imports before it is forked (below): torch and specco's training and rollout stack
_PRELOAD = ["torch", "torch.distributed", "specco.parallel.mesh", "specco.train.cotrain", "specco.runner.rl",
            "specco.rollout.engine"]


def spawn_local(fn, world: int, *args) -> None:
    """Run fn(rank, world, *args) on `world` local processes with a gloo default group. `fn` must be
    importable (module level). A worker's exception is re-raised here (torch.multiprocessing).

    The workers are forked from a forkserver that imported torch and specco once (`_PRELOAD`): a spawned
    worker imports them itself, ~2 s of CPU each (4 workers on 2 cores: 9.5 s per launch, forked: 0.2 s),
    which is most of what a small multi-process test costs. The server is single-threaded when it forks
    (torch starts its thread pools at the first op), so the workers start clean."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    for attempt in (1, 2):
        try:
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_spawn_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world,
                                   join=True, start_method="forkserver")
            return
        except mp.ProcessExitedException as e:
            # A worker killed by a signal, with no Python exception: a native crash inside torch's gloo or
            # functional collectives, seen about once in a few full suite runs on 2 loaded cores in 2026-12
            # ("free(): invalid pointer" under DTensor.full_tensor, a SIGSEGV in an RL loop), never reproduced in
            # isolation. Run once more, saying so; a crash that repeats (or any Python exception) fails.
            if attempt == 2 or e.exit_code is None or e.exit_code >= 0:
                raise
            print(f"spawn_local: {e}; running {getattr(fn, '__name__', fn)} once more", file=sys.stderr)
