"""The co-training step under pipeline parallelism: 1F1B over the policy's stages, the draft on the last.

    counts = step_counts(batch)                  every stage holds the whole (DP x CP share of the) batch
    one_f_one_b over the micro-batches:
        stage forward of m  (a source stage posts m's taps on the TapChannel: no wait for the draft)
        last stage: L_policy of m -> the schedule's backward of m -> send dx upstream
                    then the draft's work for m: wait for m's taps, join them with the last stage's own,
                    lambda * L_draft -> its own backward        (overlaps the other stages' backwards)
    optimizer_step: gradients summed over the stage's DP x CP ranks, the policy's clip norm over the
                    pipeline group (the stages hold disjoint parts), the draft's on the last stage alone

The pieces are `cotrain.py`'s (step_counts, policy_loss, micro_batches, optimizer_step) and the EAGLE-3 loss of train/drafters.py:
the same losses divided by the same global counts, so the gradients equal the unsplit step's
(tests/test_pp_cotrain.py). The pipeline's own forward, backward and point-to-point traffic do not
depend on the draft: taps are detached copies on their own process group, and the draft's work
runs after the schedule's upstream send (the recorded send/recv sequence is the same without it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..batch import TrainBatch
from ..model.draft import Eagle3Draft
from ..model.policy import Policy, Taps
from ..model.ttt import shift_left
from ..ops.attention import ttt_attention
from ..parallel.pipeline import PipeComm, one_f_one_b
from .drafters import EAGLE3
from .cotrain import (StepConfig, amp_context, micro_batches, optimizer_step, picks_rows, policy_loss,
                      step_counts)
from .losses import all_reduce_sums, metrics_to_floats

__all__ = ["pp_cotrain_step"]


@dataclass
class _TeacherOut:  # what the draft's loss (drafters.EAGLE3.loss) reads of a policy output: the joined taps and the teacher logits
    taps: Taps
    logits: torch.Tensor


def pp_cotrain_step(stage: Policy, draft: Eagle3Draft | None, batch: TrainBatch, opt: torch.optim.Optimizer, sched,
                    cfg: StepConfig, *, pipe: PipeComm, taps=None, tap_layers: tuple[int, ...] | None = None,
                    step: int = 0, grad_group=None, shift: Callable = shift_left, attn: Callable = ttt_attention,
                    attn_core: Callable | None = None, block=None, grad_sync: dict | None = None,
                    act_dtype: torch.dtype | None = None) -> dict:
    """One optimizer step of this pipeline stage on `batch` (the stage's DP x CP share); returns the step's
    metrics as floats on every stage (the last stage's, broadcast over the pipeline group).

    stage: this rank's `split_stage`; draft: the draft on the last stage (None elsewhere, or to train
    the policy alone); pipe: the schedule's PipeComm on the pp group; taps: the TapChannel (None: no
    draft this step); tap_layers: the draft's aux layer ids (every stage needs them to know what to
    tap); step: the stamp of this step's taps; grad_group: the stage's DP x CP ranks; shift / attn /
    attn_core as in `cotrain_step` (context parallelism passes its ring versions); block: the block
    drafters' CP plan that `cp.step_fns` also returns — accepted so the same layout functions pass
    through, unused: the pipeline co-trains EAGLE-3 drafts only (a block drafter is refused below).
    grad_sync: the optimizer groups' gradient strategies (train/grad_sync.py; a stage sharded by
    parallel.fsdp.apply_fsdp, with reshard_after_forward=False as 1F1B wants: `grad_syncs(stage, grad_group)`,
    its reduce-scatter then runs in each micro-batch's backward); None: both all-reduced over grad_group.
    act_dtype: the dtype of the activations the stages exchange, i.e. of the residual stream (None: the
    parameters'). Under `cfg.amp_dtype` (autocast) with fp32 weights the residual adds promote to fp32, so the
    parameters' dtype is right; under FSDP's mixed_precision(bf16) the stage computes in bf16 weights and the
    residual is bf16: pass torch.bfloat16 (a mismatch is an error naming both, never a garbled receive).
    """
    pp, s = pipe.pp, pipe.stage
    first, last = s == 0, s == pp - 1
    if batch.packed and attn_core is None:
        raise ValueError("a packed batch needs a packing-aware attention core (see cotrain_step)")
    use_draft = tap_layers is not None and cfg.draft_weight > 0
    if use_draft and last and (draft is None or tuple(tap_layers) != draft.cfg.aux_layer_ids):
        raise ValueError(f"the last stage trains the draft: it needs the draft, whose aux_layer_ids must be "
                         f"tap_layers={tap_layers}")
    if use_draft and pp > 1:
        if taps is None:
            raise ValueError("a draft under parallel.pp > 1 needs the TapChannel (parallel.taps.TapChannel)")
        if taps.R < pp:  # 1F1B's warmup runs stage 0 pp - 1 forwards ahead (parallel/taps.py: slots and 1F1B)
            raise ValueError(f"TapChannel slots={taps.R} < parallel.pp={pp}: the first stage would wait for "
                             "credits the last stage cannot give yet (deadlock); use slots >= pp + 1")
    mbs = list(micro_batches(batch, cfg.micro_batch_rows, cfg.draft_row_stride, cfg.width_multiple))
    counts = step_counts(batch, cfg, shift, grad_group)
    p = next(stage.parameters())
    wire = act_dtype or p.dtype  # the receive buffers' dtype, forward and backward
    losses = {"policy/loss": torch.zeros((), dtype=torch.float64), "draft/loss": torch.zeros((), dtype=torch.float64)}
    stats: dict = {"policy": None, "draft": None}
    held: dict[int, tuple] = {}  # last stage: m -> (its own taps, teacher logits) until the draft's work on m
    opt.zero_grad(set_to_none=True)
    if taps is not None:
        taps.begin(step, len(mbs))

    def forward(m, x):
        _, mb = mbs[m]
        with amp_context(cfg, mb.tokens):  # the forward and loss under the step's precision; the backward outside
            out = stage(mb.tokens if first else None, mb.positions, tap_layers=tap_layers if use_draft else None,
                        hidden_in=x, compute_logits=last, attn_core=attn_core)
        if not last:
            if out.hidden.dtype != wire:
                raise ValueError(f"stage {s} emits {out.hidden.dtype} activations but the schedule receives {wire}: "
                                 "pass pp_cotrain_step(act_dtype=...) = the stage's compute dtype")
            if use_draft and taps is not None and taps.is_source:
                taps.post(m, out.stage_taps)  # posts and returns: the source never waits for the draft
            return out.hidden
        with amp_context(cfg, mb.tokens):
            l_pol, st = policy_loss(out.logits, mb, cfg, counts.policy_tokens, shift)
        stats["policy"] = st if stats["policy"] is None else stats["policy"] + st
        losses["policy/loss"] += l_pol.detach().double()
        if use_draft:
            held[m] = (out.stage_taps, out.logits.detach())
        return l_pol

    def draft_work(m):
        d_rows, mb = mbs[m]
        own, logits = held.pop(m)
        # every micro-batch's taps are consumed, in order, even if the row stride gives the draft none here
        parts = (taps.wait(m, *mb.tokens.shape[:2]) if taps is not None else []) + [own]
        if not picks_rows(d_rows, mb):  # as in cotrain_step: the draft's rows are global rows 0 mod n
            return
        with amp_context(cfg, mb.tokens):
            l_d, st = EAGLE3.loss(draft, None, _TeacherOut(draft.join_taps(parts), logits), mb, cfg, counts.draft,
                                  d_rows, shift=shift, attn=attn)
        stats["draft"] = st if stats["draft"] is None else stats["draft"] + st
        losses["draft/loss"] += l_d.detach().double()
        (cfg.draft_weight * l_d).backward()  # the draft's own graph: disjoint from the policy's

    one_f_one_b(pipe, len(mbs), forward, lambda m: (*mbs[m][1].tokens.shape[:2], stage.cfg.hidden_size),
                wire, p.device, after_backward=draft_work if (last and use_draft) else None)
    if taps is not None:
        taps.end()
    assert not held, f"last stage: the draft never ran on micro-batches {sorted(held)}"
    metrics = {}
    if last:
        metrics = {k: v for k, v in losses.items() if k == "policy/loss" or use_draft}
        for st in all_reduce_sums([v for v in stats.values() if v is not None], grad_group):
            metrics.update(st.metrics())
    metrics.update(optimizer_step(opt, sched, cfg, True, grad_group, pipe.group, grad_sync))
    metrics = metrics_to_floats(metrics)
    # every stage returns the same metrics: the last stage's (losses, statistics) with the common norms
    box = [metrics]
    dist.broadcast_object_list(box, group=pipe.group, group_src=pp - 1)
    return {**metrics, **box[0]}
