"""Pipeline parallelism applied from outside the model: stages by layer ranges, and a 1F1B schedule.

    ranges = stage_layer_ranges(num_layers, pp)     contiguous, any layer count (the first stages get the extra)
    stage  = split_stage(policy, pp, s)             a plain Policy holding ranges[s]; embedding on s = 0,
                                                    final norm + head on s = pp - 1 (the model file stays plain)
    one_f_one_b(comm, M, forward, backward, ...)    warmup / steady / cooldown over M micro-batches
    one_f_one_b(NoPipe(), M, ...)                   pp = 1: the stage is the whole policy, the schedule the plain
                                                    micro-batch loop (warm-up 0: forward, backward per micro-batch)
    one_f_one_b(..., sums=RouterBalance(...))       per micro-batch statistics summed over the stages before its
                                                    backward (a MoE policy's router balance, train/moe_loss.py)

The schedule is the non-interleaved 1F1B of PipeDream-Flush / Megatron: stage s runs pp - 1 - s warmup
forwards, then alternates one forward and one backward, then drains the remaining backwards. Each stage
keeps at most pp - s micro-batches' activations alive. Its point-to-point traffic goes through
`PipeComm` on the pipeline group only, and every op is recorded in `PipeComm.log`, so a test can check
that the schedule's own traffic is byte-for-byte the same with and without the tap channel (docs/DESIGN.md §5).

Why not `torch.distributed.pipelining`: its `Schedule1F1B` owns the loss call (`loss_fn(output, target)`)
and the micro-batch split, but the co-training step needs per-micro-batch batch fields in the loss (mask,
advantages, old log-probs, global counts) and a hook after each last-stage backward where the draft's
forward/backward for that micro-batch runs; it also gives no record of its P2P sequence. Writing the
three loops here is ~60 lines and keeps those hooks plain.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..model.policy import Policy
from .load import whole_items

__all__ = ["stage_layer_ranges", "split_stage", "PipeComm", "NoPipe", "one_f_one_b", "gather_stages", "stream_stages"]


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of the pp stages: sizes differ by at most one, the first stages larger
    (the last stage also holds the norm, the head and the draft)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"parallel.pp={pp}: must be in [1, num_layers={num_layers}] (every stage holds a layer)")
    q, r = divmod(num_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + q + (s < r))
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def split_stage(policy: Policy, pp: int, stage: int) -> Policy:
    """Stage `stage` of `policy` split into pp stages: a new Policy with copies of its parameters."""
    cfg = policy.cfg
    if pp > 1 and cfg.tie_word_embeddings:
        # Tied weights would live on two stages and need their gradients summed across them: not done.
        raise ValueError("parallel.pp > 1 with tie_word_embeddings=True is not supported: the embedding (first "
                         "stage) and the head (last stage) would be one parameter on two ranks")
    r = stage_layer_ranges(cfg.num_layers, pp)[stage]
    part = Policy(cfg, layer_ids=r, has_embed=stage == 0, has_head=stage == pp - 1)
    p = next(policy.parameters())
    part = part.to(device=p.device, dtype=p.dtype)
    sd = policy.state_dict()  # names are global (layers keyed by index): the stage's are a subset
    part.load_state_dict({k: sd[k] for k in part.state_dict()}, strict=True)
    return part


@torch.no_grad()
def gather_stages(stage: Policy, pp_group) -> dict[str, torch.Tensor]:
    """The full policy's state dict on every stage of `pp_group`, whole (`stream_stages` collected: the saved policy,
    tests). Names are the unsplit model's (layers keyed by global index), so it loads into an unsplit Policy with
    strict=True. A collective: every rank of every stage calls it."""
    return dict(stream_stages(stage, pp_group))


@torch.no_grad()
def stream_stages(stage: Policy, pp_group, bucket_bytes: int = 256 * 2**20):
    """(name, whole tensor) of the full policy on every stage of `pp_group`, stage after stage, in buckets of at most
    `bucket_bytes` (or one tensor larger than that): the refit's stream (runner/refit.state_buckets), so no rank
    holds the whole policy — one bucket, and under expert parallelism one layer's experts, at a time. Each bucket
    is one broadcast over the pipeline group of its tensors flattened (the stages' dtypes agree); which names, shapes
    and dtypes each stage holds is one small object exchange up front, so every rank cuts the same buckets. A
    collective: every rank of every stage walks the whole stream, in order (the stage's own FSDP / ep gathers happen
    as its turn comes)."""
    pp, me = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    names = [None] * pp
    dist.all_gather_object(names, [(k, tuple(v.shape), str(v.dtype)) for k, v in whole_items(stage, False)],
                           group=pp_group)
    dev = next(stage.parameters()).device
    for s in range(pp):
        if not names[s]:
            continue
        dtype = getattr(torch, names[s][0][2].removeprefix("torch."))  # the flat buffer's: the first tensor's
        buckets, size = [[]], 0
        for entry in names[s]:  # the same cut on every rank
            n = int(torch.Size(entry[1]).numel()) * dtype.itemsize
            if buckets[-1] and size + n > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(entry)
            size += n
        mine = whole_items(stage, True) if s == me else None
        for bucket in buckets:
            sizes = [int(torch.Size(shape).numel()) for _, shape, _ in bucket]
            if mine is not None:
                parts = []
                for k, _, _ in bucket:
                    name, t = next(mine)
                    assert name == k, (name, k)
                    parts.append(t.reshape(-1).to(dtype))
                flat = torch.cat(parts)
                del parts
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=dev)
            dist.broadcast(flat, group=pp_group, group_src=s)
            for (k, shape, dt), piece in zip(bucket, flat.split(sizes)):
                yield k, piece.reshape(shape).to(getattr(torch, dt.removeprefix("torch.")))
            del flat


_TAGS = {"fwd": 0, "bwd": 1, "sums_fwd": 2, "sums_bwd": 3}  # a message's kind -> its p2p tag


class PipeComm:
    """The schedule's point-to-point traffic with the neighbouring stages, on `group` (the pp group).

    `send_*` post an isend and return at once (its handle is kept until `wait_sends`); `recv_*` post an
    irecv and wait for it. With sends never awaited inline, the 1F1B order cannot deadlock (a stage
    blocks only on a receive whose matching send was already posted). Every op is appended to `log` as
    (op, peer stage, micro-batch, shape, dtype)."""

    def __init__(self, group):
        self.group = group
        self.stage = dist.get_rank(group)
        self.pp = dist.get_world_size(group)
        self.log: list[tuple] = []
        self._sends: list = []

    def _send(self, what, t, peer, m):
        t = t.contiguous()
        self.log.append((what, peer, m, tuple(t.shape), str(t.dtype)))
        self._sends.append((dist.isend(t, group=self.group, group_dst=peer, tag=_TAGS[what[5:]]), t))

    def _recv(self, what, shape, dtype, device, peer, m):
        self.log.append((what, peer, m, tuple(shape), str(dtype)))
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(t, group=self.group, group_src=peer, tag=_TAGS[what[5:]]).wait()
        return t

    def send_fwd(self, act, m):
        self._send("send_fwd", act, self.stage + 1, m)

    def send_sums(self, sums, m, upstream: bool):
        """A micro-batch's stage sums (one_f_one_b's `sums`): the prefix downstream with the activation, the
        totals upstream with the gradient; tags of their own, so they never match an activation's receive."""
        peer = self.stage - 1 if upstream else self.stage + 1
        self._send("send_sums_bwd" if upstream else "send_sums_fwd", sums, peer, m)

    def recv_sums(self, n, device, m, upstream: bool):
        return self._recv("recv_sums_bwd" if upstream else "recv_sums_fwd", (n,), torch.float64, device,
                          self.stage + 1 if upstream else self.stage - 1, m)

    def send_bwd(self, grad, m):
        self._send("send_bwd", grad, self.stage - 1, m)

    def recv_fwd(self, shape, dtype, device, m):
        return self._recv("recv_fwd", shape, dtype, device, self.stage - 1, m)

    def recv_bwd(self, shape, dtype, device, m):
        return self._recv("recv_bwd", shape, dtype, device, self.stage + 1, m)

    def wait_sends(self):
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    @property
    def idle(self) -> bool:
        return not self._sends


class NoPipe:
    """The pipe of one stage (pp = 1): the only stage is first and last, so 1F1B never sends or receives and
    runs as the plain micro-batch loop. Lets the co-training step be one function for every pp (REVIEW item 2)."""
    group, stage, pp, idle = None, 0, 1, True

    def __init__(self):
        self.log: list[tuple] = []  # always empty: no traffic

    def wait_sends(self):
        pass


def one_f_one_b(comm: PipeComm | NoPipe, num_micro: int, forward: Callable, act_shape: Callable, dtype, device,
                after_backward: Callable | None = None, sums=None) -> None:
    """Run the 1F1B schedule of this stage over `num_micro` micro-batches.

    forward(m, x) -> y: micro-batch m's stage forward; x is the received activation (a leaf that requires
        grad) or None on the first stage; y the activation to send (non-last stages) or the loss to
        backpropagate (last stage; None when it has nothing to backpropagate: a frozen policy, pp = 1 only).
        The schedule runs the backwards itself: y.backward(dy) and x.grad
        upstream, so a stage's backward is exactly autograd's over its forward.
    act_shape(m): the (B, S, h) activation shape of micro-batch m (every stage holds the whole batch).
    after_backward(m): last stage only, after micro-batch m's backward and its upstream send (the draft's
        per-micro-batch work goes here: it overlaps the earlier stages' backwards, off the critical path).
    sums: per micro-batch statistics that must be summed over the stages before the micro-batch's backward (a
        MoE policy's router balance: train/moe_loss.RouterBalance), or None. After forward(m, x),
        `sums.add(m, prefix)` returns the stages' sums up to this one (an fp64 vector of `sums.numel`; prefix None
        on the first stage), sent downstream with the activation; the last stage's are the totals, which travel
        back with the gradient, and `sums.loss(m, totals)` (a scalar or None) is backpropagated together with the
        stage's output. With pp = 1 nothing travels: the stage's own sums are the totals.
    """
    s, pp = comm.stage, comm.pp
    first, last = s == 0, s == pp - 1
    warmup = min(pp - 1 - s, num_micro)
    live: dict[int, tuple] = {}  # m -> (x, y): micro-batches forwarded, not yet backpropagated
    totals: dict[int, torch.Tensor] = {}  # last stage, with `sums`: m -> the stages' sums until m's backward

    def fwd(m):
        x = prefix = None
        if not first:
            x = comm.recv_fwd(act_shape(m), dtype, device, m).requires_grad_()
            if sums is not None:
                prefix = comm.recv_sums(sums.numel, device, m, upstream=False)
        y = forward(m, x)
        if sums is not None:
            upto = sums.add(m, prefix)
        if not last:
            comm.send_fwd(y.detach(), m)
            if sums is not None:
                comm.send_sums(upto, m, upstream=False)
        elif sums is not None:
            totals[m] = upto
        live[m] = (x, y)

    def bwd(m):
        x, y = live.pop(m)
        roots, grads = [], []
        if last:
            tot = totals.pop(m) if sums is not None else None
            if y is not None:
                roots, grads = [y], [None]
        else:
            roots, grads = [y], [comm.recv_bwd(act_shape(m), dtype, device, m)]
            tot = comm.recv_sums(sums.numel, device, m, upstream=True) if sums is not None else None
        extra = sums.loss(m, tot) if sums is not None else None
        if extra is not None:  # the stage's own term (e.g. its routers' share of the balance loss), same backward
            roots, grads = roots + [extra], grads + [None]
        if roots:
            torch.autograd.backward(roots, grads)
        if not first:
            comm.send_bwd(x.grad, m)
            if sums is not None:
                comm.send_sums(tot, m, upstream=True)
        if last and after_backward is not None:
            after_backward(m)

    # warmup: fill the pipe (stage s runs pp - 1 - s forwards ahead; the last stage none)
    for m in range(warmup):
        fwd(m)
    # steady: one forward, then the backward of the oldest live micro-batch
    for i in range(num_micro - warmup):
        fwd(warmup + i)
        bwd(i)
    # cooldown: drain the backwards of the warmup forwards
    for m in range(num_micro - warmup, num_micro):
        bwd(m)
    comm.wait_sends()
    assert not live and not totals, f"stage {s}: micro-batches {sorted(live)} forwarded but never backpropagated"
    assert comm.idle, f"stage {s}: sends still in flight after the cooldown"
