"""Expert parallelism of the trainer's mixture-of-experts layers (issue 38 item 2), applied from outside the plain
model (STYLE §1): `apply_ep` swaps each sparse layer's `Experts` (model/moe.py) for an `EPExperts` that holds
E / ep of them and sends every row to the rank of its expert and back with all-to-all.

    mesh = Mesh.build(dp=4, ep=2)                 # parallel.ep = 2
    policy = copy.deepcopy(policy)                # the trainer's copy (the engine keeps the whole policy)
    apply_ep(policy, mesh.ep_group, mesh.ep_replica_group)
    opt = build_optimizer(policy, draft, ...)     # after the swap: AdamW holds the local expert slices

**Placement.** ep borrows its ranks from the stage's dp × cp ranks (parallel/mesh.py: consecutive runs of ep of
them, cp innermost), as torchtitan does from dp_shard × cp: those ranks already hold *different tokens*, so
sending a token to another rank's expert is exactly the traffic expert parallelism needs, and the world does not
grow (an ep axis of its own would give its ranks the same tokens and nothing to dispatch). So ep must divide
dp × cp and num_experts. Rank j of an ep group holds experts [j·E/ep, (j+1)·E/ep): the 3-D expert tensors cut
along dim 0. The router (`gate`) and Qwen2-MoE's shared expert stay replicated like the rest of the layer: every
rank routes its own rows.

**Dispatch and combine** (`EPExperts.forward`, per sparse layer, ep ranks, N local rows, k experts each):

    1. the N·k (row, expert) assignments sorted by expert (as Experts.forward): since a rank's experts are a
       contiguous id range, the sorted assignments are grouped by destination rank too
    2. counts (E,) exchanged (all-to-all of (ep, E/ep)): how many rows each source sends to each local expert
    3. the rows dispatched (all-to-all, uneven splits): this rank receives them grouped by SOURCE rank, then by
       local expert within a source
    4. permuted to local-expert order (stable argsort of each received row's local expert), one GEMM pair per
       local expert, permuted back (the inverse permutation: the combine must undo 4 or outputs land on the
       wrong rows — tests/test_ep.py mutates this)
    5. combined (the reverse all-to-all), weighted by the router's weights and added back to their rows

Both all-to-alls are differentiable (`_AllToAll`: the backward of an all-to-all is the all-to-all with the split
sizes swapped), so the expert gradients of rank j sum over the rows every rank of its ep group sent, and the rows'
gradients (hence the router's and the layers' below) come back to the ranks that own them.

**Gradients.** An expert slice is NOT replicated over the ep group: its gradient is summed over the ranks that
hold the SAME slice (`ep_replica_group`: the grad_group ranks with the same position in their ep group), never
over the ep group (that would add other experts' gradients into it: the test's second mutation). The dense and
replicated parameters keep their all-reduce over grad_group. train/grad_sync.EPSync does both, and its clip takes
the norm of the expert slices summed over the ep group. The router's aux loss reads the local router logits, as
at ep 1: unchanged.

**With FSDP** (parallel.dp_shard; tests/test_ep_fsdp.py). The recipe (trainer.make_arm, through
parallel/load.sharded_copy): `apply_ep` on the meta model, activation checkpointing, then `apply_fsdp`: the dense
parameters (attention, norms, the router `gate`, Qwen2-MoE's shared expert, embeddings, head) become DTensor shards
over mesh.fsdp_mesh and are reduce-scattered inside the backward as for a dense policy. The slices are not the fsdp
mesh's (its other ranks hold other experts): where a slice is held by several ranks (its replica group, dp × cp / ep
of them), FSDP shards it over exactly those as a unit of its own inside its layer's (torchtitan's `dp_shard_in_ep`:
the experts' memory / the replicas; gathered for the layer, its gradient reduce-scattered over the replicas); where
each rank holds its slice alone (ep = dp × cp) it stays a plain tensor (`fully_shard(ignored_params=)`). EPSync (over
FSDPSync for the rest) leaves FSDP's slices to it and sums plain ones over the replica group as above. The clip's
norm is the dense DTensors' norm plus the slices' squared norms summed over the ep group. ep and the fsdp mesh are
both cut from the stage's dp × cp ranks and need not agree: ep 2 inside dp_shard 4, or ep 4 across two HSDP
replicas, are the same code. The KL reference is placed and sharded the same way; the refit gathers the shards (in
buckets) and the experts (`full_expert_state`); sharded checkpoints hold both with global shapes (a replica-sharded
slice as Shard(0) of the (ep, ep_replica) mesh: `expert_meshes`), so a run resumes at ep × dp_shard or at ep 1
without FSDP (tested; other ep / dp_shard combinations go through the same DCP resharding, untested). Under FSDP
at ep 1 (no EPExperts) the experts are sharded with their layers instead (parallel/fsdp.py).

Every rank of an ep group must run the same sparse-layer forwards and backwards (the all-to-alls are collectives):
the same number of micro-batches per step, which the runner's even split of prompts over dp gives.

**The whole policy.** The engine holds every expert, so the refit gathers them a layer at a time (`expert_stream`:
an all-gather of each 3-D tensor along dim 0 over the ep group, a collective every rank calls), and so does the
whole policy the run
evaluates and saves (runner/rl.full_models: the trainer's masters, gathered). A rank's own `state_dict()` reports its
experts under their global HF names (and loads back: the state copies of the measurement hooks). Sharded checkpoints
save each slice as its Shard(0) of the whole (E, ...) tensor (`expert_meshes`, `as_global`; AdamW's moments too), so a
run resumes at any ep, 1 included.

A rank's experts run model/moe.expert_ffn, Experts' own: the grouped GEMM where it applies (Hopper, bf16 or bf16
autocast over fp32 masters), else the loop. The dispatch reads its split sizes on the host, so an ep layer is never
CUDA-graphed (the engine holds every expert: it never is one). Not here: tp with ep (refused).

**Under pipeline parallelism** (tests/test_ep_pp.py) each stage is cut from the whole policy first, then its sparse
layers' experts placed over that stage's own ep group (parallel/mesh.py cuts ep groups from every stage's dp × cp
ranks); a stage of dense layers only keeps what it has (`apply_ep(strict=False)`). The refit gathers each stage's
experts a layer at a time as the stages are streamed (pipeline.stream_stages, ep.expert_stream); the clip sums each
stage's dense and whole-expert squares over the pipeline group (EPSync.clip).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..model.moe import Experts, SparseMoE, expert_ffn

__all__ = ["apply_ep", "EPExperts", "is_ep", "expert_parameters", "full_expert_state", "expert_stream", "ep_groups",
           "expert_meshes", "as_global", "check_same_micro_batches", "slice_offsets"]


def ep_groups(stage_ranks: list[int], ep: int, rank: int):
    """(ep_group, ep_replica_group) of `rank` among `stage_ranks` (the stage's dp × cp ranks of one tp rank, in
    mesh order, cp innermost): ep groups are consecutive runs of `ep` ranks, replica groups the ranks at the same
    position of every run. A collective (new_group): every rank calls it with the same arguments. The replica group
    is None when ep covers the whole stage (the slices are not replicated: nothing to sum)."""
    n = len(stage_ranks)
    if ep < 1 or n % ep:
        raise ValueError(f"parallel.ep={ep} must divide the stage's dp × cp ranks ({n})")
    ep_group = replica = None
    for i in range(0, n, ep):
        g = dist.new_group(stage_ranks[i:i + ep])
        if rank in stage_ranks[i:i + ep]:
            ep_group = g
    if n > ep:
        for j in range(ep):
            members = stage_ranks[j::ep]
            g = dist.new_group(members)
            if rank in members:
                replica = g
    return ep_group, replica


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, differentiable: rows (sum(send), h) -> (sum(recv), h); the backward
    sends the output's gradient back along the same routes (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


class EPExperts(nn.Module):
    """This rank's E / ep experts of one sparse layer, with Experts' forward signature (x, idx, weights) -> out,
    so SparseMoE.mix runs unchanged. `gate_up_proj` (E/ep, 2I, h) and `down_proj` (E/ep, h, I) are the slices
    [first, first + E/ep) of the whole layer's tensors."""

    def __init__(self, whole: Experts, group, replica_group):
        super().__init__()
        self.group, self.replica_group = group, replica_group
        self.ep, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        E = whole.num_experts
        if E % self.ep:
            raise ValueError(f"parallel.ep={self.ep} does not divide num_experts={E}")
        self.num_experts, self.inter, self.local = E, whole.inter, E // self.ep
        self.first = self.ep_rank * self.local  # global id of this rank's first expert
        cut = slice(self.first, self.first + self.local)
        # clones: the slices must not keep the whole (E, ...) storage alive
        self.gate_up_proj = nn.Parameter(whole.gate_up_proj.detach()[cut].clone())  # (E/ep, 2I, h)
        self.down_proj = nn.Parameter(whole.down_proj.detach()[cut].clone())  # (E/ep, h, I)
        self.register_state_dict_post_hook(_local_expert_names)
        self.register_load_state_dict_pre_hook(_join_local_experts)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, h), idx (N, k) global expert ids, weights (N, k) -> (N, h): Experts.forward's result, the
        experts computed on their ranks (module docstring, steps 1-5)."""
        N, k = idx.shape
        ep, El = self.ep, self.local
        flat = idx.reshape(-1)  # (N·k,)
        order = flat.argsort(stable=True)  # (N·k,) assignments by expert, hence by destination rank
        rows = order // k  # (N·k,) the row of each sorted assignment
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))  # (E,) rows sent to each expert
        # 2. what each source sends to each of my experts: (ep, E/ep) -> (ep sources, E/ep local experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(ep, El)  # (ep, E/ep)
        send = counts.view(ep, El).sum(1).tolist()  # rows to each destination rank
        recv = recv_counts.sum(1).tolist()  # rows from each source rank
        # 3. dispatch: (N·k, h) sorted by expert -> (R, h) grouped by source, then local expert
        xr = _AllToAll.apply(x[rows], send, recv, self.group)
        # 4. each received row's local expert, then the rows in local-expert order (stable: by source within one)
        local_ids = torch.arange(El, device=x.device).repeat(ep)  # (ep·E/ep,) matches recv_counts.flatten()
        le = torch.repeat_interleave(local_ids, recv_counts.flatten())  # (R,)
        perm = le.argsort(stable=True)  # (R,)
        ys = self._experts(xr[perm], recv_counts.sum(0))  # (R, h) in local-expert order
        yr = _unpermute(ys, perm)  # (R, h) back in arrival order
        # 5. combine: the reverse all-to-all -> (N·k, h) in this rank's sorted order, then Experts.forward's tail
        y = _AllToAll.apply(yr, recv, send, self.group)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)  # (N·k, h)
        return torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype))

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the rows they received, xs (R, h) in local-expert order, counts (E/ep,) on the
        device: model/moe.expert_ffn (the grouped GEMM where it applies, autocast's casts, else the loop)."""
        if xs.shape[0]:
            return expert_ffn(xs, counts, self.gate_up_proj, self.down_proj)
        # No rows at all: (0, h) still derived from xs, so the graph keeps both all-to-alls and this rank's
        # backward joins its peers' (an output without a grad_fn would skip them: a hang), and from both slices
        # (times 0), so they get a zero gradient like their peers' and every rank joins the reduction over the
        # replica group (FSDP's reduce-scatter of the slices, or EPSync's all-reduce)
        return xs * 0 + (self.gate_up_proj.sum() + self.down_proj.sum()).to(xs.dtype) * 0


def _unpermute(ys: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The inverse of `xs = xr[perm]`: yr with yr[perm] = ys (differentiable; a scatter, no argsort)."""
    return torch.empty_like(ys).index_copy(0, perm, ys)


def _local_expert_names(mod, state, prefix, local_metadata):
    """state_dict post-hook of EPExperts: this rank's experts under their GLOBAL per-expert names (HF's, as
    Experts reports them), views of the local slices. A partial state dict: `full_expert_state` gathers it.
    Slices FSDP shards over their replica group (DTensors, parallel/fsdp.py) stay stacked under their own names: no
    rank holds an expert's rows whole to view (state copies load them back as they are)."""
    if isinstance(state[f"{prefix}gate_up_proj"], DTensor):
        return
    gate_up, down = state.pop(f"{prefix}gate_up_proj"), state.pop(f"{prefix}down_proj")
    I = mod.inter
    for j in range(mod.local):
        e = mod.first + j
        state[f"{prefix}{e}.gate_proj.weight"] = gate_up[j, :I]  # (I, h)
        state[f"{prefix}{e}.up_proj.weight"] = gate_up[j, I:]  # (I, h)
        state[f"{prefix}{e}.down_proj.weight"] = down[j]  # (h, I)


def _join_local_experts(mod, state, prefix, local_metadata, strict, missing, unexpected, errors):
    """load_state_dict pre-hook of EPExperts, the inverse of `_local_expert_names`: this rank's experts under their
    global per-expert names stacked into the local slices (a copy of this rank's state dict loads back: the
    state copies of train.on_nonfinite=skip and the plain baseline). A partial set is left alone, so the strict
    load names what is missing."""
    ids = range(mod.first, mod.first + mod.local)
    keys = [f"{prefix}{e}.{p}.weight" for e in ids for p in ("gate_proj", "up_proj", "down_proj")]
    if all(k in state for k in keys):
        g = {e: [state.pop(f"{prefix}{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")] for e in ids}
        state[f"{prefix}gate_up_proj"] = torch.stack([torch.cat(g[e][:2]) for e in ids])  # (E/ep, 2I, h)
        state[f"{prefix}down_proj"] = torch.stack([g[e][2] for e in ids])  # (E/ep, h, I)


def apply_ep(policy: nn.Module, group, replica_group=None, strict: bool = True) -> nn.Module:
    """Swap every sparse layer's experts of `policy` (in place) for this rank's slice over `group` (the ep
    group); `replica_group`: the ranks holding the same slice (their gradients are summed over it). Before the
    optimizer is built. strict=False: a pipeline stage whose layers are all dense (mlp_only_layers) is left as it
    is (its ep group then has nothing to dispatch on that stage). Returns `policy`."""
    swapped = 0
    for mod in policy.modules():
        if isinstance(mod, SparseMoE) and isinstance(mod.experts, Experts):
            mod.experts = EPExperts(mod.experts, group, replica_group)
            swapped += 1
    if not swapped and strict:
        raise ValueError("parallel.ep > 1 but the policy has no mixture-of-experts layers to place; set parallel.ep=1")
    return policy


def is_ep(policy: nn.Module | None) -> bool:
    return policy is not None and any(isinstance(m, EPExperts) for m in policy.modules())


def expert_parameters(policy: nn.Module) -> tuple[list[nn.Parameter], object, object]:
    """(the expert slices' parameters, the ep group, the replica group) of an `apply_ep`'d policy."""
    mods = [m for m in policy.modules() if isinstance(m, EPExperts)]
    return [p for m in mods for p in m.parameters()], mods[0].group, mods[0].replica_group


def check_same_micro_batches(policy: nn.Module, n: int) -> None:
    """Raise on every rank of the ep group when its ranks would run different numbers of micro-batches (`n` here):
    each sparse forward and backward is an all-to-all of the whole group, so a rank with one micro-batch more
    would wait forever for peers that have finished. One all-reduce of two ints per step."""
    _, group, _ = expert_parameters(policy)
    dev = next(policy.parameters()).device
    t = torch.tensor([n, -n], dtype=torch.long, device=dev)  # (max n, -min n) after the MAX all-reduce
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t[0].item() != -t[1].item():
        raise RuntimeError(f"parallel.ep: the ranks of an ep group have between {-t[1].item()} and {t[0].item()} "
                           "micro-batches this step; expert parallelism needs the same number on each (the "
                           "all-to-alls are collectives): give every data-parallel rank as many rows")


@torch.no_grad()
def full_expert_state(policy: nn.Module) -> dict[str, torch.Tensor]:
    """`policy.state_dict()` with every expert whole (the checkpoint's and the saved policy's view): each
    EPExperts' slices all-gathered along dim 0 over its ep group into (E, 2I, h) / (E, h, I), reported under the E
    per-expert names. A collective: every rank of the ep group (and of the replica group, where FSDP shards the
    slices over it) calls it, layers in the same (module) order. Every expert of every layer is held at once: the
    refit streams them a layer at a time instead (`expert_stream`)."""
    return dict(expert_stream(policy))


@torch.no_grad()
def expert_stream(policy: nn.Module, gather: bool = True):
    """(name, tensor) of `policy.state_dict()` with every expert whole, as `full_expert_state` orders them (the
    dense entries, then each sparse layer's E experts), each layer's experts gathered only when the walk reaches
    them: a consumer that drops what it has passed (the refit's buckets) holds one layer's experts at a time, not
    every expert of the policy (most of a MoE's parameters). The same collectives in the same order on every rank.
    gather=False: no collective, each whole expert tensor a meta-device placeholder of its shape and dtype (what a
    receiver allocates: pipeline.stream_stages)."""
    state = policy.state_dict()
    mods = [(f"{name}.", mod) for name, mod in policy.named_modules() if isinstance(mod, EPExperts)]
    local = tuple(prefix for prefix, _ in mods)
    for k, v in state.items():  # the dense entries (the local experts' views and stacked names left out)
        if not k.startswith(local):
            yield k, v
    for prefix, mod in mods:
        I = mod.inter
        if not gather:
            h, E, dt = mod.gate_up_proj.shape[-1], mod.num_experts, mod.gate_up_proj.dtype
            for e in range(E):
                for part, shape in (("gate_proj", (I, h)), ("up_proj", (I, h)), ("down_proj", (h, I))):
                    yield f"{prefix}{e}.{part}.weight", torch.empty(shape, dtype=dt, device="meta")
            continue
        whole = []
        for p in (mod.gate_up_proj, mod.down_proj):
            mine = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()  # (E/ep, ...) the whole slice
            parts = [torch.empty_like(mine) for _ in range(mod.ep)]  # (E/ep, ...) each, in ep-rank order
            dist.all_gather(parts, mine.contiguous(), group=mod.group)
            whole.append(torch.cat(parts))  # (E, ...): rank-major is expert order
        gate_up, down = whole
        del whole
        for e in range(mod.num_experts):
            yield f"{prefix}{e}.gate_proj.weight", gate_up[e, :I]
            yield f"{prefix}{e}.up_proj.weight", gate_up[e, I:]
            yield f"{prefix}{e}.down_proj.weight", down[e]


def slice_offsets(model: nn.Module) -> dict[str, int]:
    """{FQN of each expert slice parameter in `model`: the row of the whole (E, ...) tensor that is its row 0, i.e.
    its first expert's id}: where a copy filled from the whole policy reads a slice's rows (parallel/load.py's
    sharded_copy under ep × FSDP). Empty without expert parallelism."""
    return {f"{name}.{p}": mod.first for name, mod in model.named_modules() if isinstance(mod, EPExperts)
            for p in ("gate_up_proj", "down_proj")}


def expert_meshes(model: nn.Module) -> dict[str, DeviceMesh]:
    """{FQN of each expert slice parameter in `model`: the DeviceMesh its tensors are Shard(0) over}, for the
    sharded checkpoint (train/sharded_checkpoint.py), which saves them as `as_global` DTensors: each slice named
    with its place in the whole (E, ...) tensor, so the replicas of a slice are written once and any ep (1
    included) reads its own slice back. The 1-D ep mesh; where FSDP shards each slice over its replica group, the
    2-D (ep, ep_replica) mesh: the experts cut over ep, then each slice over its replicas. Empty without expert
    parallelism. Under FSDP a collective over the replica group (once per module, then cached)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, EPExperts):
            if getattr(mod, "_mesh", None) is None:  # cached per module
                dev = mod.gate_up_proj.device.type
                if isinstance(mod.gate_up_proj, DTensor):  # FSDP over the replica group: the grid of ranks (ep, R)
                    ep_ranks = torch.tensor(dist.get_process_group_ranks(mod.group))  # (ep,) my ep group's
                    rows = [torch.empty_like(ep_ranks) for _ in range(dist.get_world_size(mod.replica_group))]
                    dist.all_gather(rows, ep_ranks, group=mod.replica_group)  # (R,) × (ep,): every ep group's
                    grid = torch.stack(rows).t()  # (ep, R): [j, r] = rank j of the r-th replica's ep group
                    mod._mesh = DeviceMesh.from_group([mod.group, mod.replica_group], dev, mesh=grid,
                                                      mesh_dim_names=("ep", "ep_replica"))
                else:  # from_group is local (no collective)
                    mod._mesh = DeviceMesh.from_group(mod.group, dev, mesh_dim_names=("ep",))
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}"] = mod._mesh
    return out


def as_global(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's slice (E/ep, ...) seen as its Shard(0) of the whole (E, ...) tensor over `mesh` (no copy: the
    DTensor's local tensor IS `local`, so a checkpoint load into it fills the live tensor). A slice FSDP shards over
    its replica group (a DTensor) is its local shard under Shard(0) of the 2-D mesh (`expert_meshes`): dim 0 cut
    over ep first, then each slice over the replicas, as FSDP cuts it (torch.chunk's rule, as DTensor's)."""
    if isinstance(local, DTensor):  # the global shape given: FSDP's last chunks may be short (uneven)
        shape = torch.Size((local.shape[0] * mesh.size(0), *local.shape[1:]))  # (E, ...)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local.to_local(), mesh, [Shard(0), Shard(0)], run_check=False, shape=shape,
                                  stride=stride)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
