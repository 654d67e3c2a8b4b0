"""Peak memory per rank of the EAGLE-3 draft co-training step under context parallelism.

One long sequence of S tokens. Each rank holds its zigzag shard of the draft's inputs (aux taps,
embeddings, policy logits = the teacher, target mask) and runs the draft half of the co-training step:
K TTT passes (ring attention), the chunked soft-CE loss, normalisation by global counts, backward.

    cp = 1         the plain single-device step (shift_left, ttt_attention) — the baseline
    cp = 2, 4      specco's CP draft: ring trunk attention, local branch, cp_shift, local loss chunks
    gather, cp     the prior design: all-gather taps + teacher to every rank, run the draft on the
                   full sequence (memory does not shrink — it grows by the gathered copies)

What is measured (CPU, gloo processes — no CUDA allocator to ask):
* peak_MB: the peak of *live tensor bytes allocated during the step*. A TorchDispatchMode sees every
  aten op, including those autograd runs in backward, checkpoint recomputation and the buffers of
  collectives; each new storage is counted once (views share it) and uncounted when its storage dies
  (a weakref finalizer). It excludes what existed before the step (weights, the input shards, which are
  reported separately as inputs_MB) and a kernel's internal scratch (not tensors). It includes the draft
  weights' gradients (cp-independent, ~grads_MB). This is what torch.cuda.max_memory_allocated would
  report on a GPU, minus allocator rounding/caching.
* saved_MB: bytes saved for backward (saved_tensors_hooks, one count per storage) at the end of forward.
* inputs_MB: the rank's shard of taps + embeddings + teacher logits + mask held before the step.
(CPU only for now; on a GPU the same worker would read torch.cuda.max_memory_allocated instead.)

    python bench/cp_memory.py                       # CPU, S = 4096, cp = 1, 2, 4 + gather
    python bench/cp_memory.py --seq 1024 --small    # quicker
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specco.model.config import DraftConfig  # noqa: E402
from specco.model.draft import Eagle3Draft  # noqa: E402
from specco.model.ttt import shift_left, ttt_forward  # noqa: E402
from specco.ops.attention import ttt_attention  # noqa: E402
from specco.parallel.cp import cp_attn, cp_shift  # noqa: E402
from specco.parallel.mesh import spawn_local  # noqa: E402
from specco.parallel.zigzag import ZigzagLayout  # noqa: E402
from specco.train.losses import draft_denominator, draft_loss_parts, normalize_draft_loss, pass_weights  # noqa: E402

MB = 1e6


class LiveTensorBytes(TorchDispatchMode):
    """Peak of live tensor bytes allocated while the mode is active (see module docstring)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0

    def _free(self, key):
        self.cur -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output aliasing an input (a view, detach, an in-place op, a collective's receive buffer)
        # allocated nothing: skip it, or storages created before the step would be counted when a view
        # of them first passes through.
        aliased = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = id(st)  # storage PyObjects are preserved while the storage lives: a stable key
                if key not in self.live and key not in aliased:
                    self.live[key] = st.nbytes()
                    self.cur += st.nbytes()
                    self.peak = max(self.peak, self.cur)
                    weakref.finalize(st, self._free, key)
        return out


def _build(a):
    torch.manual_seed(0)
    h = a.hidden
    dc = DraftConfig(hidden_size=h, intermediate_size=2 * h, num_heads=a.heads, num_kv_heads=a.kv_heads,
                     head_dim=h // a.heads, target_vocab_size=a.vocab, draft_vocab_size=a.draft_vocab,
                     aux_layer_ids=(1, 2, 3))
    draft = Eagle3Draft(dc)
    g = torch.Generator().manual_seed(1)
    S = a.seq
    inputs = {  # what the policy forward hands the draft, for the whole sequence (B = 1)
        "aux": torch.randn(1, S, 3 * h, generator=g), "embed": torch.randn(1, S, h, generator=g),
        "logits": torch.randn(1, S, a.vocab, generator=g) * 3, "mask": (torch.rand(1, S, generator=g) > 0.1).float(),
    }
    return draft, inputs


def _worker(rank, world, a, mode, out_path):
    draft, full = _build(a)
    S = a.seq
    lay = ZigzagLayout((0, S), world, rank)
    group = dist.group.WORLD if world > 1 else None
    local = {k: lay.shard(v) for k, v in full.items()} if mode != "single" else full
    del full
    inputs_mb = sum(v.numel() * v.element_size() for v in local.values()) / MB
    grads_mb = sum(p.numel() * p.element_size() for p in draft.parameters()) / MB
    saved: dict[int, int] = {}

    def pack(t):
        saved.setdefault(id(t.untyped_storage()), t.untyped_storage().nbytes())
        return t

    mem = LiveTensorBytes()
    t0 = time.perf_counter()
    with mem:
        if mode == "gather":  # the prior design: every rank materialises the whole sequence's inputs
            def gather(x):
                parts = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(parts, x.contiguous(), group=group)
                return lay.unshard(parts)
            ins = {k: gather(v) for k, v in local.items()}
            shift, attn, pos, count_group = shift_left, ttt_attention, torch.arange(S)[None], None
        elif mode == "cp":
            ins = local
            shift = functools.partial(cp_shift, group=group, layout=lay)
            attn, pos, count_group = cp_attn(group, lay), lay.positions()[None], group
        else:
            ins, shift, attn, pos, count_group = local, shift_left, ttt_attention, torch.arange(S)[None], None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = ttt_forward(draft, ins["aux"], ins["embed"], pos, a.passes, shift=shift, attn=attn)
            parts = draft_loss_parts(draft, outs, ins["logits"], ins["mask"], a.chunk, shift)
            w = pass_weights(a.passes, 0.8)
            n = torch.stack([c.detach().double() for c in parts.count])  # (K,) global counts: one home
            if count_group is not None:
                dist.all_reduce(n, group=count_group)
            loss = normalize_draft_loss(parts, w, draft_denominator(n, w))
        saved_mb = sum(saved.values()) / MB
        loss.backward()
        del outs, parts, loss, ins
    secs = time.perf_counter() - t0
    Path(out_path, f"{mode}_{world}_{rank}.json").write_text(json.dumps({
        "mode": mode, "cp": world, "rank": rank, "peak_MB": mem.peak / MB, "saved_MB": saved_mb,
        "inputs_MB": inputs_mb, "grads_MB": grads_mb, "seconds": secs}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--small", action="store_true", help="S = 1024, vocab 2048/1024: a quick check")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.small:
        a.seq, a.vocab, a.draft_vocab = 1024, 2048, 1024
    cps = [int(c) for c in a.cps.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("single", 1)] + [(m, c) for c in cps if c > 1 for m in ("cp", "gather")]
        for mode, world in runs:
            if world == 1:
                torch.set_num_threads(1)
                _worker(0, 1, a, mode, tmp)
            else:
                spawn_local(_worker, world, a, mode, tmp)
            per_rank = [json.loads(Path(tmp, f"{mode}_{world}_{r}.json").read_text()) for r in range(world)]
            rows.append({k: (max(p[k] for p in per_rank) if k.endswith(("MB", "seconds")) else per_rank[0][k])
                         for k in per_rank[0] if k != "rank"})
    base = rows[0]
    for r in rows:
        r["peak_vs_cp1"] = r["peak_MB"] / base["peak_MB"]
        r["saved_vs_cp1"] = r["saved_MB"] / base["saved_MB"]
        r["goal_1.15/cp"] = 1.15 / r["cp"] if r["mode"] != "gather" else None
        r["meets_goal"] = (r["peak_vs_cp1"] <= 1.15 / r["cp"]) if r["mode"] != "gather" else None
    print(f"draft co-training step memory per rank (max over ranks), S={a.seq}, h={a.hidden}, "
          f"Vd={a.draft_vocab}, V={a.vocab}, K={a.passes}, chunk={a.chunk}, fp32")
    print(f"{'mode':>7} {'cp':>3} {'inputs_MB':>10} {'saved_MB':>9} {'peak_MB':>9} {'peak/cp1':>9} "
          f"{'goal':>6} {'sec':>6}")
    for r in rows:
        goal = f"{r['goal_1.15/cp']:.3f}" if r["goal_1.15/cp"] else "-"
        print(f"{r['mode']:>7} {r['cp']:>3} {r['inputs_MB']:>10.1f} {r['saved_MB']:>9.1f} {r['peak_MB']:>9.1f} "
              f"{r['peak_vs_cp1']:>9.3f} {goal:>6} {r['seconds']:>6.1f}")
    out = Path(a.out or os.environ.get("OUT", "bench/results")) / "cp_memory_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
