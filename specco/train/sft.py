"""Supervised fine-tuning (SFT) of the policy on reference completions (the job's `[sft]` stage).

The demo starts from a from-scratch tiny policy that knows nothing; SFT teaches it the task's
format and most of the arithmetic, so that RL starts from a policy with non-trivial but imperfect
accuracy when sampling at temperature 1 (the regime where GRPO has signal to learn from). A user's
pretrained policy gets this stage only when `[sft] data` names a file of prompts and completions.

    loss = sum_{t in completion} -log p(x_t | x_<t) / #completion tokens     (prompt tokens masked)

Batches are examples `offset + step * batch_size, ...` of the source's stream `seed` (data.source: each
example's `prompt_ids` and `reference` text), so a resumed run sees the same data.

Data-parallel (`sft(..., group=G)`, every rank of G calling it with the same model): each rank trains on rows
rank::world of every batch; the loss is divided by the batch's GLOBAL completion-token count (one scalar
all-reduce) and the gradients are SUMMED over G (train/grad_sync.reduce_grads, as the RL step), so every rank
ends with the same bits (an all-reduce gives every rank the same result) and with the single-process model up
to summation order (tests/test_sft_dp.py).

`generate_simple` is deliberately the dumbest correct decoder -- a full-recompute forward per new
token, no KV cache -- so this module does not depend on the rollout engine (`train` and `rollout`
never import each other).
"""
from __future__ import annotations

import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from specco.batch import device_indices, longest_first, mask_spans, round_up
from specco.data.source import reference_ids
from specco.model.config import ConfigError, PolicyConfig
from specco.model.moe_config import MOE_FAMILIES
from specco.train.grad_sync import reduce_grads
from specco.train.moe_loss import aux_share


def tiny_policy_config(tokenizer, hidden_size: int = 96, num_layers: int = 4, num_heads: int = 4,
                       num_kv_heads: int = 2, intermediate_size: int = 256,
                       max_position_embeddings: int = 256, rope_theta: float = 10000.0, *, family: str = "llama",
                       num_experts: int = 0, num_experts_per_tok: int = 0,
                       moe_intermediate_size: int = 0) -> PolicyConfig:
    """A from-scratch policy sized for a CPU demo, matched to `tokenizer`: Llama-style, or Qwen3 (q/k norm), or
    Qwen3-MoE (every MLP a mixture of `num_experts` experts, top `num_experts_per_tok`, renormalised as Qwen3-MoE
    checkpoints do, transformers' default aux-loss weight: model/moe_config.MOE_FAMILIES)."""
    moe = {}
    if family == "qwen3_moe":
        moe = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                   moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True,
                   router_aux_loss_coef=MOE_FAMILIES["qwen3_moe"]["router_aux_loss_coef"])
    return PolicyConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size,
                        intermediate_size=intermediate_size, num_layers=num_layers,
                        num_heads=num_heads, num_kv_heads=num_kv_heads,
                        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, model_type=family,
                        qk_norm=family != "llama", bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                        **moe)


def sft_batch(examples, tokenizer, device="cpu"):
    """Right-padded (input_ids, loss_mask), both (B, S).

    loss_mask[b, t] is 1 where token t+1 is a completion token (so logits[:, t] predict it):
    the mask is aligned with the *inputs*, the targets are input_ids shifted left by one.
    Right padding needs no attention mask: real tokens never attend to later (pad) positions.
    """
    seqs, masks = [], []
    for e in examples:
        p, c = e.prompt_ids, reference_ids(e, tokenizer)
        seqs.append(p + c)
        masks.append([0] * (len(p) - 1) + [1] * len(c) + [0])  # predict c from positions p-1..
    S = max(map(len, seqs))
    ids = torch.full((len(seqs), S), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), S), dtype=torch.float32)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids.to(device), mask.to(device)


def sft_loss(policy, input_ids, loss_mask, num_tokens=None, logits_from: int = 0):
    """Next-token cross-entropy summed over completion tokens (logits in fp32 at least), divided by `num_tokens`
    (default: this batch's own completion-token count, i.e. the mean); a mixture-of-experts policy adds its
    router_aux_loss_coef times its load-balancing loss over those tokens, this batch's share of it
    (train/moe_loss.aux_share), as transformers trains with output_router_logits and as the GRPO step does.
    `logits_from`: no loss_mask entry before it is set (`sft_micro_batches` knows it): the logits only from there
    (Policy.forward's logits_from: a long prompt's vocabulary-sized logits are never made)."""
    out = policy(input_ids, logits_from=logits_from)
    c = out.logits_from
    logits = out.logits[:, :-1]  # (B, S-1-c, V) predicts tokens c+1..S-1
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least (fp64 in tests)
    targets = input_ids[:, c + 1:]
    mask = loss_mask[:, c:-1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         reduction="none").view_as(mask)
    n = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    loss = (ce * mask).sum() / n
    coef = policy.cfg.router_aux_loss_coef
    if out.router_logits and coef > 0:  # a mixture of experts: its load balancing, as in the GRPO step
        loss = loss + coef * aux_share(out.router_logits, policy.cfg.num_experts_per_tok, loss_mask, n)
    return loss


def sft_micro_batches(input_ids, loss_mask, rows: int, width_multiple: int = 1):
    """(input_ids, loss_mask, first) micro-batches of `rows` rows, longest first, each cut after its longest row
    (0 or >= B: the whole batch, first 0), the width rounded up to a multiple of `width_multiple` (sft.width_multiple)
    with columns of id 0 and mask 0. Right padding, causal attention: the columns cut or added are only padding, which
    no marked column attends to and no loss reads. `first`: the micro-batch's first marked column (sft_loss's
    logits_from), from the same host read."""
    B = input_ids.shape[0]

    def widen(ids, mask, width):  # (b, w) -> (b, width) with padding columns
        extra = width - ids.shape[1]
        return (F.pad(ids, (0, extra)), F.pad(mask, (0, extra))) if extra > 0 else (ids, mask)

    if rows <= 0 or rows >= B:
        yield *widen(input_ids, loss_mask, round_up(input_ids.shape[1], width_multiple)), 0
        return
    first, end = mask_spans(loss_mask)
    # the mask marks the inputs that predict a completion token: a row needs its last marked input + 1
    length = torch.where(end > 0, end + 1, 0).clamp(max=loss_mask.shape[1])
    chunks = longest_first(length, rows)
    for chunk, idx in zip(chunks, device_indices(chunks, input_ids.device)):  # one copy, no host sync (batch.py)
        cut = max(2, int(length[chunk[0]]))
        yield *widen(input_ids[idx, :cut], loss_mask[idx, :cut], round_up(cut, width_multiple)), \
            min(int(first[chunk].min()), cut - 2)


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear 0 -> 1 over `warmup` steps, then cosine 1 -> min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def sft(policy, tokenizer, source, steps: int, batch_size: int = 128, lr: float = 3e-3,
        seed: int = 0, offset: int = 0, warmup: int | None = None, weight_decay: float = 0.01,
        grad_clip: float = 1.0, progress: bool = True, amp_dtype: torch.dtype | None = None,
        micro_batch_rows: int = 0, group=None, width_multiple: int = 1) -> dict:
    """Train `policy` in place for `steps` AdamW steps; returns metrics.

    `amp_dtype` (train.amp): the forward and loss under autocast in that dtype, fp32 weights and AdamW
    state (the long-reasoning workload's 2.5K-token references would double the activations in fp32).
    `micro_batch_rows` (train.sft_micro_batch_rows): each batch in micro-batches of that many rows, longest
    first and cut to their own length, gradients accumulated to the whole batch's mean (long-tailed
    references: a direct answer of 5 tokens beside a worked one of 2,000 no longer pads to it). `width_multiple`
    (sft.width_multiple): those widths rounded up to its multiples (sft_micro_batches), so few shapes recur.

    Data: examples `offset + k*batch_size ...` of `source`'s stream `seed`; the returned `offset` is where
    the next stage (or a resumed SFT) continues.

    `group` (a process group, None: this process alone): data-parallel over its ranks (module docstring); the
    returned losses are the global batch's, the same on every rank. Needs batch_size >= its size.
    """
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    if batch_size < world:
        raise ConfigError(f"SFT batch of {batch_size} rows over {world} data-parallel ranks: every rank needs a "
                         f"row; set sft.batch >= {world}")
    device = next(policy.parameters()).device
    warmup = max(1, steps // 20) if warmup is None else warmup
    decay = [p for n, p in policy.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in policy.named_parameters() if p.dim() < 2]  # norms: no weight decay
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, steps, warmup))
    policy.train()
    losses, gnorms = [], []
    t0, c0 = time.perf_counter(), time.process_time()
    bar = tqdm(range(steps), desc="sft", disable=not progress, dynamic_ncols=True)
    for step in bar:
        examples = source.examples(batch_size, seed=seed, offset=offset)[rank::world]  # this rank's rows
        offset += batch_size
        ids, mask = sft_batch(examples, tokenizer, device)
        n_tok = mask[:, :-1].sum()
        if group is not None:  # the global batch's count: each rank's loss is its share of the global mean
            dist.all_reduce(n_tok, group=group)
        n_tok = n_tok.clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb_ids, mb_mask, first in sft_micro_batches(ids, mask, micro_batch_rows, width_multiple):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                part = sft_loss(policy, mb_ids, mb_mask, n_tok, logits_from=first)
            part.backward()
            loss = loss + part.detach()
        reduce_grads(policy.parameters(), group)  # SUM: the losses are divided by the global count already
        if group is not None:
            dist.all_reduce(loss, group=group)
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        gnorms.append(gnorm.item())
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", gnorm=f"{gnorm.item():.2f}")
    policy.eval()
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - c0  # CPU seconds of all threads: robust to a busy machine
    tail = losses[-max(1, min(20, len(losses))):] if losses else [float("nan")]
    return {"steps": steps, "loss_first": losses[0] if losses else float("nan"),
            "loss_last": sum(tail) / len(tail), "losses": losses, "grad_norms": gnorms, "time_s": elapsed,
            "cpu_s": cpu_s, "steps_per_s": steps / elapsed if elapsed > 0 else float("nan"),
            "offset": offset}


@torch.no_grad()
def generate_simple(policy, prompt_ids: list[list[int]], max_new_tokens: int, eos_id: int,
                    temperature: float = 0.0, generator: torch.Generator | None = None):
    """Sample continuations; returns per-prompt lists of new token ids (up to and without <eos>).

    Prompts are bucketed by length so no padding (and no attention mask) is needed; each bucket is
    decoded with a full forward over the whole sequence per new token. temperature 0 = greedy.
    """
    device = next(policy.parameters()).device
    buckets = defaultdict(list)
    for i, p in enumerate(prompt_ids):
        buckets[len(p)].append(i)
    out: list[list[int]] = [[] for _ in prompt_ids]
    for _, rows in sorted(buckets.items()):
        seq = torch.tensor([prompt_ids[i] for i in rows], dtype=torch.long, device=device)  # (b, P)
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = policy(seq).logits[:, -1].float()  # (b, V) at the last position
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        for r, i in enumerate(rows):
            new = seq[r, len(prompt_ids[i]):].tolist()
            out[i] = new[:new.index(eos_id)] if eos_id in new else new
    return out
