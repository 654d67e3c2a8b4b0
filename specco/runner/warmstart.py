"""Draft warm start: train the draft (EAGLE-3, DFlash or DSpark) offline against a frozen policy.

Data are the policy's own samples on task prompts (what the draft will have to predict during RL),
generated once by the rollout engine without a draft. The draft then trains with the co-training
step in offline mode (policy frozen). Afterwards the simulated acceptance length from TTT
(teacher-forced top-1 agreement chains) is compared with the real tau of the rollout engine.

`warm_start(..., group=G)` is data-parallel over G's ranks (each with the same pool and draft): every rank draws
the same batch of pool rows and trains on a contiguous share of it (`dp_rows`), the co-training step summing
counts and gradients over G (its `grad_group`), so every rank ends with the same draft.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..model.config import ConfigError, DraftConfig
from ..model.dflash import BlockDraft, BlockDraftConfig
from ..model.draft import Eagle3Draft, build_vocab_maps
from ..model.policy import Policy
from ..rollout.engine import RolloutEngine
from ..rollout.config import GenerateConfig
from ..train.cotrain import StepConfig, TrainBatch, build_optimizer, cotrain_step
from .rollouts import pad_pairs, rollout_pairs


def sample_pool(policy: Policy, source, tokenizer, n_prompts: int, group: int, gen_cfg: GenerateConfig,
                seed: int, batch_prompts: int = 32):
    """Policy samples on training prompts (`source`: data.source.PromptSource, stream `seed`): right-padded tokens
    (N, S) and completion mask (N, S)."""
    g = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    seqs = []
    with RolloutEngine(policy, None, gen_cfg) as engine:
        for off in range(0, n_prompts, batch_prompts):
            prompts = [e.prompt_ids for e in source.examples(min(batch_prompts, n_prompts - off), seed=seed, offset=off)]
            seqs += rollout_pairs(prompts, engine.generate(prompts, group_size=group, generator=g))
    return pad_pairs(seqs, tokenizer.pad_id)


# The automatic draft vocabulary (draft.draft_vocab_size = 0). Small vocabularies (the tiny char
# model's ~100 tokens) are kept whole. Large ones (SmolLM2: 49,152) are cut to the most frequent
# tokens of the warm-start pool: the draft's fp32 teacher/student logits are B x S x Vd per TTT
# pass, so the full head made a 64-row warm-start batch need > 10 GB on CPU, while task completions
# use a few hundred distinct tokens. EAGLE-3 releases use 32k drafts for 128k-152k targets.
FULL_VOCAB_MAX = 8192
AUTO_DRAFT_VOCAB = 4096


def resolve_draft_vocab(requested: int, target_vocab: int) -> int:
    """The draft vocabulary size for `requested` (0 = automatic, see above) and a target vocab."""
    if requested < 0:
        raise ValueError(f"draft_vocab_size={requested}: must be >= 0 (0 = automatic)")
    if requested:
        return min(requested, target_vocab)
    return target_vocab if target_vocab <= FULL_VOCAB_MAX else AUTO_DRAFT_VOCAB


def new_draft(policy: Policy, tokens: torch.Tensor, draft_vocab_size: int = 0,
              aux_layer_ids=(), init_head: bool = True) -> Eagle3Draft:
    """A draft for `policy` with its vocabulary chosen by token frequency in `tokens`.

    `draft_vocab_size` 0 picks the size with `resolve_draft_vocab` (full vocab for small targets, else the
    4096 most frequent tokens); ties in frequency go to the lower token id.
    """
    V = policy.cfg.vocab_size
    dv = resolve_draft_vocab(draft_vocab_size, V)
    dc = DraftConfig.for_policy(policy.cfg, dv, tuple(aux_layer_ids) or None)
    draft = Eagle3Draft(dc).to(next(policy.parameters()).device)
    counts = torch.bincount(tokens.flatten().cpu(), minlength=V).float()
    d2t, t2d = build_vocab_maps(counts, dv)
    draft.set_vocab_maps(d2t.to(draft.d2t.device), t2d.to(draft.t2d.device))
    if init_head:
        draft.init_head_from_policy(policy.lm_head.weight.detach())
    return draft


def mask_token_id(tokens: torch.Tensor, vocab_size: int, fallback: int | None = None) -> int:
    """A block drafter's mask token: the highest id never seen in the warm-start pool `tokens` (docs/DESIGN.md §2b: a
    reserved token that data never contain; its frozen embedding row is the mask embedding). A tiny char
    policy's samples can cover its whole ~100-token vocabulary; then `fallback` (the tokenizer's pad id: a
    fixed row the drafter learns to read as "mask" — only the quality of the cue depends on it being unused)."""
    counts = torch.bincount(tokens.flatten().cpu(), minlength=vocab_size)
    unused = (counts == 0).nonzero().flatten()
    if unused.numel():
        return int(unused[-1])
    if fallback is None:
        raise ConfigError(f"every one of the {vocab_size} token ids occurs in the warm-start samples: a block "
                          "drafter needs a reserved (unused) token for its mask embedding")
    return int(fallback)


def new_block_draft(policy: Policy, tokens: torch.Tensor, kind: str, gamma: int, aux_layer_ids=(),
                    mask_fallback: int | None = None, num_layers: int = 0, num_anchors: int = 0) -> BlockDraft:
    """A DFlash / DSpark drafter for `policy` proposing `gamma` tokens per block (rollout.k), with `num_layers`
    decoder layers and `num_anchors` trained blocks per sequence (0: BlockDraftConfig's 1 and 16)."""
    mask_id = mask_token_id(tokens, policy.cfg.vocab_size, mask_fallback)
    extra = {k: v for k, v in (("num_layers", num_layers), ("num_anchors", num_anchors)) if v}
    bc = BlockDraftConfig.for_policy(policy.cfg, kind, gamma, mask_id,
                                     aux_layer_ids=tuple(aux_layer_ids) or None, **extra)
    p = next(policy.parameters())
    return BlockDraft(bc).to(device=p.device)


def load_draft_dir(path, device="cpu") -> Eagle3Draft | BlockDraft:
    """A draft saved by `Eagle3Draft.save` or `BlockDraft.save` (or in a serving layout): `export.load_any_draft`,
    the one dispatch on what a draft directory holds."""
    from ..export import load_any_draft
    return load_any_draft(path, device=device)


def initial_draft(policy: Policy, tokens: torch.Tensor, spec, gamma: int | None = None,
                  mask_fallback: int | None = None) -> Eagle3Draft | BlockDraft:
    """The draft the warm start begins from: `spec.init` (config `draft.init=DIR`) imported and checked
    against the policy, else a new one of `spec.kind` (`new_draft`, `new_block_draft` with `gamma` =
    rollout.k tokens per block; `mask_fallback`: `mask_token_id`'s). `spec` is the run config's DraftSpec."""
    if spec.kind != "eagle3":
        if spec.draft_vocab_size:
            raise ConfigError(f"draft.draft_vocab_size={spec.draft_vocab_size}: block drafters (draft.kind="
                              f"{spec.kind}) use the policy's own head; leave it 0")
        if not spec.init:
            if gamma is None:
                raise ValueError("a new block drafter needs gamma (rollout.k)")
            return new_block_draft(policy, tokens, spec.kind, gamma, spec.aux_layer_ids, mask_fallback,
                                   spec.block_layers, spec.num_anchors)
        from ..export import load_block_draft  # specco's layout or DFlash's serving one, checked against the policy
        draft = load_block_draft(spec.init, policy.cfg, device=next(policy.parameters()).device)
        if draft.kind != spec.kind or (gamma is not None and draft.cfg.gamma < gamma):
            raise ConfigError(f"draft.init={spec.init} is a {draft.kind} drafter with gamma={draft.cfg.gamma}; the "
                              f"run asks draft.kind={spec.kind} with rollout.k={gamma}")
        for key, want, got in (("block_layers", spec.block_layers, draft.cfg.num_layers),
                               ("num_anchors", spec.num_anchors, draft.cfg.num_anchors)):
            if want and want != got:
                raise ConfigError(f"draft.{key}={want} but draft.init={spec.init} has {got}; leave it 0 or match")
        return draft
    if not spec.init:
        return new_draft(policy, tokens, spec.draft_vocab_size, spec.aux_layer_ids, spec.init_head_from_policy)
    from ..export import load_draft
    draft = load_draft(spec.init, policy.cfg, device=next(policy.parameters()).device)
    for key, want, got in (("draft_vocab_size", spec.draft_vocab_size, draft.cfg.draft_vocab_size),
                           ("aux_layer_ids", tuple(spec.aux_layer_ids), draft.cfg.aux_layer_ids)):
        if want and want != got:
            raise ConfigError(f"draft.{key}={want!r} but draft.init={spec.init} has {got!r}; leave "
                              f"draft.{key} unset (the imported draft decides it)")
    return draft


def dp_rows(n: int, stride: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of a batch of `n` rows over `world` ranks, cut at multiples of `stride`: the
    draft trains on the rows 0 mod train.draft_row_stride of the batch it is given (cotrain.micro_batches), so a
    share that starts at such a row trains on exactly the whole batch's draft rows that fall in it."""
    blocks = -(-n // stride)  # the batch's draft rows, one per block of `stride` rows
    if blocks < world:
        raise ConfigError(f"a warm-start batch of {n} rows trains the draft on {blocks} (train.draft_row_stride="
                         f"{stride}), fewer than the {world} data-parallel ranks: set train.warm_start_batch >= "
                         f"{world * stride}")
    lo, hi = rank * blocks // world, (rank + 1) * blocks // world
    return slice(lo * stride, min(n, hi * stride))


def warm_start(policy: Policy, draft: Eagle3Draft, tokens: torch.Tensor, mask: torch.Tensor,
               steps: int, lr: float, batch_size: int, scfg: StepConfig, seed: int = 0,
               progress: bool = True, group=None) -> list[dict]:
    """Offline draft training on a fixed pool; returns per-step metrics, the global batch's (the same on every rank
    of `group`: cotrain_step's draft/loss, each rank's share, summed here).
    `group`: data-parallel over its ranks (module docstring)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    share = dp_rows(batch_size, scfg.draft_row_stride, rank, world)
    # The policy (not trained here) only serves the draft's rows, the batch's rows 0 mod draft_row_stride (the
    # share starts on one): its forward runs on those alone, at stride 1 -- the same rows, loss and counts, at a
    # stride-th of the policy's work (it ran on every row: the long-context warm start's 8 x 33K-token rows for 2).
    keep = slice(None, None, scfg.draft_row_stride)
    scfg = dataclasses.replace(scfg, draft_row_stride=1)
    opt = build_optimizer(None, draft, lr, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * max(0.1, 1 - s / max(1, steps)))
    g = torch.Generator().manual_seed(seed)
    hist = []
    policy.eval()
    draft.train()
    for step in tqdm(range(steps), desc="draft warm start", disable=not progress, leave=False):
        # the same draw on every rank (one generator seed), then this rank's share of it
        idx = torch.randint(0, tokens.shape[0], (batch_size,), generator=g)[share][keep]
        dev = next(policy.parameters()).device
        b = TrainBatch(tokens=tokens[idx].to(dev), target_mask=mask[idx].to(dev))
        m = cotrain_step(policy, draft, b, opt, sched, scfg, train_policy=False, grad_group=group)
        if group is not None:
            loss = torch.tensor([m["draft/loss"]], dtype=torch.float64, device=dev)
            dist.all_reduce(loss, group=group)
            m["draft/loss"] = loss.item()
        hist.append(m)
    return hist


@torch.no_grad()
def measure_tau(policy: Policy, draft: Eagle3Draft, source, n_prompts: int, gen_cfg: GenerateConfig,
                seed: int) -> dict:
    """Real tau and speed of the engine with this draft vs without, on held-out prompts, generating
    with `gen_cfg` (the run's own rollout config, `derive.generate_config`, at the temperature to measure)
    but at its fixed k: speculation control off, so tau measures the draft at the k it was trained for (the
    simulated tau's k), not the controller's choices (on the H200 the tail re-check lowered a warm DFlash
    draft's tau from ~5.8 to 4.8 with the same per-position acceptance)."""
    gen_cfg = dataclasses.replace(gen_cfg, spec_control=False)
    prompts = [e.prompt_ids for e in source.examples(n_prompts, seed=seed, offset=0)]
    res = {}
    for name, d in (("plain", None), ("draft", draft)):
        with RolloutEngine(policy, d, gen_cfg) as eng:
            t = time.perf_counter()
            out = eng.generate(prompts, group_size=1,
                               generator=torch.Generator(device=next(policy.parameters()).device).manual_seed(seed))
            dt = time.perf_counter() - t
        res[name] = {"tau": out.tau, "tokens_per_s": float(out.lengths.sum()) / dt,
                     "accept_rate": [round(x, 4) for x in out.accept_rate.tolist()]}
    return res
