"""The RL loop's pieces under pipeline parallelism (parallel.pp > 1), used by trainer.py and rl.py.

What each rank holds (rank = (pp_rank · dp + dp_rank) · cp + cp_rank, parallel/mesh.py):
    its pipeline stage of the training policy (`split_stage`: a layer range; the embedding on stage 0,
    the final norm and head on the last), its optimizer state, and — on the last stage — the co-trained
    draft; plus a whole copy of the policy (and draft) in its rollout engine, refit after every step
    from the gathered stages. Under FSDP (parallel.dp_shard) the stage is sharded over its dp_shard x cp
    ranks (trainer.make_arm, after the cut): the gathers below gather each stage's shards first. Rollouts
    are generated once per DP rank (pipeline stage 0, CP rank 0) and shared with the other stages and CP
    ranks (rollouts.collect_rollouts).

Per PPO update: `cotrain_step` over the stage (1F1B, the TapChannel feeding the draft). Refit: `stream_stages` (one
broadcast per bucket over the pipeline group, stage after stage: no rank holds the whole policy) plus the draft's
state from the last stage — the streamed refit timed as `time/gather` in the metrics. Checkpoints are sharded (arm_checkpoint.py): each stage writes its layers and
their AdamW moments, so a run resumes at another parallel.pp (or on one process).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..parallel.mesh import Mesh
from ..parallel.pipeline import PipeComm, gather_stages, split_stage, stage_layer_ranges, stream_stages
from ..parallel.taps import TapChannel, TapSpec
from ..train.cotrain import micro_batches
from ..train.cotrain import cotrain_step
from ..train.grad_sync import grad_syncs
from .derive import draft_updates

__all__ = ["PipelineArm", "pp_train_updates", "gather_for_refit"]


@dataclass
class PipelineArm:
    mesh: Mesh
    stage: Policy
    pipe: PipeComm
    tap_layers: tuple[int, ...] | None  # the co-trained draft's aux layers (None: no draft trains)
    taps: TapChannel | None = None  # built (and grown) for the micro-batch shapes it meets
    # what the stages exchange (activations, taps): None = the stage parameters' dtype (fp32 masters: also under
    # autocast, whose residual adds promote to fp32); bf16 under FSDP's bf16 mixed precision (trainer.make_arm)
    act_dtype: torch.dtype | None = None
    updates: int = 0  # stamps: one step number per PPO update

    @property
    def last(self) -> bool:
        return self.mesh.pp_rank == self.mesh.pp - 1

    @classmethod
    def build(cls, mesh: Mesh, policy: Policy, draft: Eagle3Draft | None) -> "PipelineArm":
        stage = split_stage(policy, mesh.pp, mesh.pp_rank)
        return cls(mesh, stage, PipeComm(mesh.pp_group), draft.cfg.aux_layer_ids if draft is not None else None)

    def channel(self, mbs, micro_batch_rows: int, width_multiple: int = 1) -> TapChannel | None:
        """The tap channel, sized for the largest micro-batch of `mbs`. Every stage of a (dp, cp) pipeline
        holds the same batches, so all of them decide to grow it at the same update (no message needed)."""
        if self.tap_layers is None:
            return None
        need = max(b.tokens.numel() for mb in mbs for _, b in micro_batches(mb.batch, micro_batch_rows,
                                                                                   width_multiple=width_multiple))
        if self.taps is None or self.taps.spec.max_tokens < need:
            cfg = self.stage.cfg
            dtype = self.act_dtype or next(self.stage.parameters()).dtype
            spec = TapSpec.for_stages(stage_layer_ranges(cfg.num_layers, self.mesh.pp), self.tap_layers,
                                      cfg.hidden_size, dtype, need)
            # pp + 1 slots: in 1F1B no source ever waits for a credit (parallel/taps.py: slots and 1F1B)
            self.taps = TapChannel(spec, self.mesh.tap_group, slots=self.mesh.pp + 1)
        return self.taps


def pp_train_updates(st, train_draft, mbs, scfg, epochs: int, grad_group, every: int = 1) -> list[dict]:
    """The PPO updates of one RL step on this stage: epochs × minibatches co-training steps (1F1B over the stage);
    the draft co-trains in every `every`-th update (train.draft_update_stride), the same updates on every stage."""
    pa: PipelineArm = st.pipeline
    # FSDP's reduce-scatter for a sharded stage (apply_fsdp without reshard after forward), else the all-reduce
    sync = grad_syncs(pa.stage, grad_group, reshard_after_forward=False)
    hist = []
    for u, mb in enumerate(mb for _ in range(epochs) for mb in mbs):
        # None: no draft trains (arms none, frozen; a co-trained arm's updates between its draft's)
        use = pa.tap_layers if scfg.draft_weight > 0 and draft_updates(u, every) else None
        taps = pa.channel(mbs, scfg.micro_batch_rows, scfg.width_multiple) if use is not None else None
        hist.append(cotrain_step(pa.stage, train_draft if use is not None else None, mb.batch, st.opt, None, scfg,
                                 pipe=pa.pipe, taps=taps, tap_layers=use, step=pa.updates, grad_group=grad_group,
                                 grad_sync=sync, act_dtype=pa.act_dtype, layout=mb.layout))
        pa.updates += 1
    return hist


def _draft_state(st, mesh: Mesh, dtype: torch.dtype | None = None) -> dict | None:
    """The co-trained draft's state from the last stage, on every stage (None for other arms): one broadcast
    per tensor over the pipeline group, no pickle. Every rank's engine holds a draft of the same architecture,
    so its state dict gives the names, shapes and dtypes the receivers allocate; the last stage sends its
    trainer's tensors in those dtypes (what the refit would cast them to anyway), or its floating tensors in
    `dtype` (the trainer's: the whole draft the run saves, rl.full_models)."""
    if st.mode != "cotrained":
        return None
    mine = st.draft.state_dict() if st.pipeline.last else None
    out = {}
    for k, like in st.engine.draft.state_dict().items():
        dt = dtype if dtype is not None and like.is_floating_point() else like.dtype
        buf = (mine[k].detach().to(dt).contiguous() if mine is not None
               else torch.empty(like.shape, dtype=dt, device=like.device))
        dist.broadcast(buf, group=mesh.pp_group, group_src=mesh.pp - 1)
        out[k] = buf
    return out


def gather_for_refit(st, mesh: Mesh, dtype: torch.dtype | None = None, bucket_bytes: int | None = None) -> tuple:
    """(whole policy state, draft state) on every rank: the stages gathered over the pipeline group; the draft's in
    the engine's dtypes, or in `dtype` (the trainer's). bucket_bytes: the policy as a stream of (name, tensor) in
    buckets of that size (pipeline.stream_stages: the refit's, which writes each bucket into the engine and drops
    it), None: a whole state dict. The draft's broadcasts run here, before the stream's: the same order on every
    rank."""
    policy = (stream_stages(st.policy, mesh.pp_group, bucket_bytes) if bucket_bytes is not None
              else gather_stages(st.policy, mesh.pp_group))
    return policy, _draft_state(st, mesh, dtype)
