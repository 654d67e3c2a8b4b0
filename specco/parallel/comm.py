"""Ring communication behind three verbs: `send_recv`, `commit`, `wait` (STYLE §5).

A ring loop then reads

    nxt = comm.send_recv([k, v]); comm.commit()   # post: our shard -> next rank, prev's -> us
    ... compute on the current shard ...          # overlaps with the transfer
    comm.wait(); k, v = nxt                       # swap

`send_recv` only *queues* point-to-point ops; `commit` posts everything queued as one
`dist.batch_isend_irecv` (on NCCL one grouped launch, so the send and the receive of a step cannot
deadlock against each other); `wait` blocks until every posted op has finished, after which the
receive buffers are valid and the send buffers may be reused. Two RingComm objects on the same group
(K/V forward and dK/dV backward) use different tags, and each side posts in the same order, so
messages never pair with the wrong receive (gloo matches on (peer, tag); NCCL on issue order).

The group is an argument; ring neighbours are group ranks (`group_peer`), so the ring works on any
sub-group (e.g. the CP group of a dp×cp mesh).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RingComm"]


class RingComm:
    """Ring neighbours in `group`: we send to rank+1 and receive from rank−1 (group ranks, mod size)."""

    def __init__(self, group, tag: int = 0):
        self.group = group
        self.tag = tag
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.send_to = (self.rank + 1) % self.world
        self.recv_from = (self.rank - 1) % self.world
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._keep: list[torch.Tensor] = []  # buffers referenced by in-flight ops: alive until `wait`

    def send_recv(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Queue: each tensor -> next rank; a same-shaped buffer <- previous rank. Returns the buffers
        (valid only after `commit` + `wait`)."""
        recv = []
        for t in tensors:
            t = t.contiguous()
            r = torch.empty_like(t)
            self._ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=self.send_to, tag=self.tag))
            self._ops.append(dist.P2POp(dist.irecv, r, group=self.group, group_peer=self.recv_from, tag=self.tag))
            self._keep += [t, r]
            recv.append(r)
        return recv

    def commit(self) -> None:
        """Post everything queued since the last commit."""
        if self._ops:
            self._reqs += dist.batch_isend_irecv(self._ops)
            self._ops = []

    def wait(self) -> None:
        """Block until every posted op completed (receives landed, sends may be overwritten)."""
        for req in self._reqs:
            req.wait()
        self._reqs, self._keep = [], []

    @property
    def idle(self) -> bool:
        """Nothing queued or in flight — ring loops assert this when they end."""
        return not self._ops and not self._reqs
