"""Co-training steps with context parallelism on a synthetic packed batch (a thin entry point).

    torchrun --nproc-per-node 4 -m specco cotrain-cp --config configs/demo.toml parallel.cp=2 parallel.dp=2
    torchrun --nproc-per-node 2 -m specco cotrain-cp parallel.cp=2 --steps 3 --seq-lens 300,41,7

The CLI will call `run_cotrain_step_cp(cfg, ...)`; everything it does is the recipe of cp.py:
per batch, build the ZigzagLayout, shard the packed batch, and pass the CP shift, ring attention
and policy attention core to `cotrain_step` (`layout.ZigzagPack`). Metrics are printed on rank 0.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.distributed as dist

from ..batch import TrainBatch
from ..config import RunConfig
from ..config_load import load_config
from ..model.config import ConfigError, DraftConfig, PolicyConfig
from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from ..parallel.cp import shard_batch
from ..parallel.layout import ZigzagPack
from ..parallel.mesh import Mesh, launched_world
from ..parallel.zigzag import ZigzagLayout
from ..train.activation_checkpointing import apply_activation_checkpointing
from ..train.nonfinite import check_finite
from ..train.cotrain import build_optimizer, cotrain_step
from .derive import check_parallel, step_config

__all__ = ["run_cotrain_step_cp", "synthetic_packed_batch", "main"]

_SYNTH_VOCAB = 256  # the tiny policy's vocabulary when no tokenizer is involved


def synthetic_packed_batch(seq_lens, vocab: int, seed: int, device=None) -> tuple[TrainBatch, tuple[int, ...]]:
    """One THD pack (B = 1) of random sequences: prompt = first quarter (mask 0), completion mask 1,
    per-token advantages constant within a sequence (GRPO's per-sample value), random old log-probs."""
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    tokens = torch.randint(0, vocab, (1, T), generator=g)
    mask, adv, cu = torch.zeros(1, T), torch.zeros(1, T), [0]
    for L in seq_lens:
        a = cu[-1]
        mask[0, a + L // 4:a + L] = 1
        adv[0, a:a + L] = torch.randn((), generator=g)
        cu.append(a + L)
    # Old log-probs near a uniform policy's, so the PPO ratio starts near 1 (as after a real rollout).
    logp_old = -math.log(vocab) + 0.05 * torch.randn(1, T, generator=g)
    batch = TrainBatch(tokens=tokens, target_mask=mask, advantages=adv, logp_old=logp_old)
    if device is not None:
        batch = TrainBatch(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(batch).items()})
    return batch, tuple(cu)


def _build_models(cfg: RunConfig, device):
    ps = cfg.policy
    if ps.source != "tiny" or ps.family != "llama":
        raise ValueError(f"run_cotrain_step_cp builds synthetic Llama-style tiny models; policy.source={ps.source!r}, "
                         f"policy.family={ps.family!r} are trained by `specco train`, not here")
    dtype = getattr(torch, ps.dtype)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    pc = PolicyConfig(vocab_size=_SYNTH_VOCAB, hidden_size=ps.hidden_size, intermediate_size=ps.intermediate_size,
                      num_layers=ps.num_layers, num_heads=ps.num_heads, num_kv_heads=ps.num_kv_heads)
    policy = Policy(pc).to(device=device, dtype=dtype)
    dc = DraftConfig.for_policy(pc, cfg.draft.draft_vocab_size or None, cfg.draft.aux_layer_ids or None)
    draft = Eagle3Draft(dc).to(device=device, dtype=dtype)
    return policy, draft


def run_cotrain_step_cp(cfg: RunConfig, steps: int = 1, seq_lens=(512, 77, 5), mesh: Mesh | None = None,
                        log=print) -> list[dict]:
    """Run `steps` co-training steps with dp × cp = cfg.parallel on synthetic packs; return metrics.

    Every dp rank gets its own pack of `seq_lens` sequences (a different seed per dp rank and step);
    the pack is zigzag-sharded over the dp rank's CP group. Must be called on every rank.
    """
    short = [n for n in seq_lens if n < 2]
    if not seq_lens or short:  # a 1-token sequence has no next token: no target, a 0/0 loss (NaN)
        raise ConfigError(f"--seq-lens {','.join(map(str, seq_lens))}: every packed sequence needs >= 2 tokens "
                          "(a token and the next one it predicts)")
    if cfg.train.kl_coef > 0:
        raise ConfigError(f"train.kl_coef={cfg.train.kl_coef}: the synthetic packs of cotrain-cp have no reference "
                          "policy; the KL penalty applies to the RL loop (`specco train`)")
    if mesh is None:
        _, dp, cp = check_parallel(cfg, launched_world(), "cotrain-cp")
        mesh = Mesh.build(dp, cp, cfg.parallel.backend)
    device = mesh.device
    policy, draft = _build_models(cfg, device)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(policy)
    t = cfg.train
    opt = build_optimizer(policy, draft, t.lr, t.draft_lr)
    # The RL loop's step config (one builder). A pack is one row: draft_row_stride and micro_batch_rows
    # act on rows, so here the draft trains on the whole pack and the pack is one micro-batch.
    step_cfg = step_config(cfg, "cotrained")
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        packed, cu = synthetic_packed_batch(seq_lens, _SYNTH_VOCAB, seed=1000 * step + mesh.dp_rank, device=device)
        zig = ZigzagLayout(cu, mesh.cp, mesh.cp_rank)
        batch = shard_batch(packed, zig)
        m = cotrain_step(policy, draft, batch, opt, None, step_cfg, grad_group=mesh.grad_group,
                         layout=ZigzagPack(mesh.cp_group, zig))
        # The two losses are each rank's contribution to the global mean: report their sum.
        losses = torch.tensor([m.get("policy/loss", 0.0), m.get("draft/loss", 0.0)], dtype=torch.float64,
                              device=device)
        dist.all_reduce(losses, group=mesh.grad_group)
        for key, v in zip(("policy/loss", "draft/loss"), losses.tolist()):
            if key in m:
                m[key] = v
        check_finite(f"cotrain-cp step {step}", m, ("policy/loss", "draft/loss", "policy/grad_norm",
                                                     "draft/grad_norm"))
        m["step"] = step
        m["tokens/local"] = zig.num_local
        if device.type == "cuda":  # this rank's figures (rank 0 prints): time incl. the metrics' syncs
            torch.cuda.synchronize(device)
            m["mem/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        m["time/step_s"] = time.perf_counter() - t0
        history.append(m)
        if mesh.rank == 0 and log is not None:
            log(json.dumps(m))  # full precision: runs compare number by number
    return history


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="[config.toml] key.sub=value ...")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--seq-lens", default="512,77,5", help="comma-separated lengths of one dp rank's pack")
    ns = ap.parse_args(argv)
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = [a for a in ns.args if "=" in a]
    cfg = load_config(path, overrides)
    run_cotrain_step_cp(cfg, ns.steps, tuple(int(x) for x in ns.seq_lens.split(",")))


if __name__ == "__main__":
    main()
