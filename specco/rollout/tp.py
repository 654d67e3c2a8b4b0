"""Tensor parallelism of the rollout engine: each rank of a tp group decodes with its shard of the policy.

    shard = tp_shard(policy, group)              this rank's copy: H/tp query and Hkv/tp kv heads, I/tp MLP rows,
    engine = RolloutEngine(shard, draft, cfg)    V/tp head rows; the draft whole on every rank
    refit: InPlaceLoad(shard, ...) takes the trainer's whole tensors and keeps this rank's slice (weights.py)

What a rank holds (Megatron's split, as the trainer's parallel/tp.py; the engine keeps its fused projections):

    qkv_proj      rows [q_r | k_r | v_r]: the rank's H/tp query heads and the Hkv/tp kv heads they read (GQA groups
                  stay whole: both counts are cut in tp contiguous blocks and G = H/Hkv is kept), biases alike
    o_proj        the input columns of those heads; its output is a partial sum, all-reduced over the group
    gate_up_proj  rows [gate_r | up_r]; down_proj the matching input columns, its output all-reduced
    MoE layers    every expert's SwiGLU (HF's per-expert gate/up/down names) and Qwen2-MoE's shared expert cut the
                  same way, I/tp of each; the router and the shared expert's sigmoid gate whole, so every rank routes
                  every row alike and runs the same experts on its slices: the block's output (weighted sum of
                  experts + gated shared expert, linear in each expert's down_proj output) is a partial sum,
                  all-reduced once per layer as the dense MLP's is
    lm_head       V/tp rows of the vocabulary; the logits all-gathered along the vocabulary (`head_logits`)
    embedding, norms, q/k norms, the draft: whole on every rank

The KV cache is the rank's kv heads only (Hkv/tp of them): the cache's memory and every step's cache read split tp
ways, which is what a long-context decode step is bound by. A layer costs two all-reduces of (B, T, h); the head
either one all-gather of (B, T, V) (`head_logits`, where the sampling rule reads whole logits) or a reduction of 5
numbers per row (below). Every rank ends with the same tokens from the same noise and keeps the same draft state, so
verification, compaction and speculation control run unchanged.

Tokens are chosen vocabulary-parallel, never from gathered logits, for every sampler but top-k / top-p (a sort over
the whole vocabulary, which gathers the head's output): greedy and coupled sampling (`pick_vocab_parallel`) reduce
each rank's V/tp logits to (best score, its id, its logit, max, sum of exponentials), one all-gather of 5 numbers
per row; plain temperature sampling (`sample_vocab_parallel`) and rejection sampling's verify
(`verify_sampling_vocab_parallel`: log-sum-exps, the draft tokens' target logits from their owners, the residual's
mass per block) draw by inverse CDF block by block, the block holding the uniform's point drawing inside itself.
Tied heads are held as an untied copy of the head's rows (the refit writes the embedding and the head's slice from
the same tensor). DSpark (its Markov bias reads whole-vocabulary rows of its own) is refused.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ..model.policy import Policy

# state-dict names (suffixes) cut along a dim, and the dim: the parts of the fused projections as the engine's model
# exposes them (layers.fuse_linears), so a refit of whole HF-named tensors slices each part by itself
_ROWS = (".q_proj.weight", ".q_proj.bias", ".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias",
         ".gate_proj.weight", ".up_proj.weight")
_COLS = (".o_proj.weight", ".down_proj.weight")


def shard_dim(name: str) -> int | None:
    """The dim along which tensor `name` of the policy is cut over the tp ranks (None: whole on every rank)."""
    if name.endswith(_ROWS) or name == "lm_head.weight":
        return 0
    if name.endswith(_COLS):
        return 1
    return None


def shard_of(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s contiguous block of `t` along `dim` (its size divisible by tp: tp_shard checks it)."""
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def local_config(c, tp: int):
    """The PolicyConfig of one engine tp rank's shard (module docstring): H/tp and Hkv/tp heads, I/tp MLP rows (every
    expert's and the shared expert's too), the head untied (its V/tp rows are sized by tp_shard). The one home of
    that shape: tp_shard builds it, plan_params.engine_params counts it."""
    local = dataclasses.replace(c, num_heads=c.num_heads // tp, num_kv_heads=c.num_kv_heads // tp,
                                intermediate_size=c.intermediate_size // tp, head_dim=c.head_dim,
                                tie_word_embeddings=False)
    if c.moe:
        local = dataclasses.replace(local, moe_intermediate_size=c.moe_intermediate_size // tp,
                                    shared_expert_intermediate_size=c.shared_expert_intermediate_size // tp)
    return local


def tp_shard(policy: Policy, group) -> Policy:
    """This rank's tensor-parallel copy of `policy` for the engine (module docstring), its tensors on the
    policy's device and in its dtype. `group`: the tp process group (its ranks all call this)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = policy.cfg
    widths = [("intermediate_size", c.intermediate_size)]
    if c.moe:  # every expert's SwiGLU (and Qwen2-MoE's shared expert) cut like the dense one
        widths += [("moe_intermediate_size", c.moe_intermediate_size),
                   ("shared_expert_intermediate_size", c.shared_expert_intermediate_size)]
    for what, n in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads), *widths,
                    ("vocab_size", c.vocab_size)):
        if n % tp:
            raise ValueError(f"engine tensor parallelism over {tp} ranks: the policy's {what} = {n} is not divisible "
                             f"by {tp}; choose a rollout tp that divides the head counts, MLP width and vocabulary")
    if policy.embed_tokens is None or policy.lm_head is None or len(policy.layers) != c.num_layers:
        raise ValueError("engine tensor parallelism needs a whole policy (embedding, every layer, head)")
    local = local_config(c, tp)
    p0 = next(policy.parameters())
    with torch.device("meta"):
        shard = Policy(local)
    shard.lm_head = nn.Linear(c.hidden_size, c.vocab_size // tp, bias=False, device="meta")
    shard = shard.to_empty(device=p0.device).to(p0.dtype)
    whole = policy.state_dict()
    with torch.no_grad():
        for name, dst in shard.state_dict().items():
            src, dim = whole[name], shard_dim(name)
            dst.copy_(src if dim is None else shard_of(src, dim, rank, tp))
    for buf_name, buf in policy.named_buffers():  # non-persistent buffers (none today) would be missed above
        if buf_name not in whole:
            raise ValueError(f"tp_shard: the policy's buffer {buf_name!r} is not in its state dict")
    shard.tp_group, shard.tp_rank, shard.tp_size = group, rank, tp
    shard.tp_slices = {n: d for n in shard.state_dict() if (d := shard_dim(n)) is not None}
    return shard.eval()


def local_part(model: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor `t` (state-dict key `name`) that `model` holds: its rank's slice for a tp shard's
    cut tensors (tp_shard's tp_slices), `t` itself otherwise. The refit writes it (weights.InPlaceLoad) and the
    refit guard fingerprints it (runner/refit.py)."""
    dim = getattr(model, "tp_slices", {}).get(name)
    return t if dim is None else shard_of(t, dim, model.tp_rank, model.tp_size)


def tp_group_of(model: nn.Module):
    """The tp group a model was sharded over (tp_shard), or None for a whole model."""
    return getattr(model, "tp_group", None)


def reduce_partial(x: torch.Tensor, group) -> torch.Tensor:
    """Sum a row-parallel projection's partial outputs over the group, in place (no-op without a group)."""
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def head_logits(policy: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The policy head's logits (..., V): under tp each rank's V/tp columns, all-gathered along the vocabulary."""
    local = policy.lm_head(hidden)
    return gather_vocab(local, tp_group_of(policy))


def gather_vocab(local: torch.Tensor, group) -> torch.Tensor:
    """(..., V/tp) blocks of the ranks in order -> (..., V) on every rank (no-op without a group)."""
    if group is None:
        return local
    blocks = _gathered(local, group, -2)  # (..., tp, V/tp)
    return blocks.flatten(-2)


def vocab_parallel(policy: nn.Module, params) -> bool:
    """Whether `policy` (a shard or not) chooses tokens from its vocabulary block under these sampling params:
    greedy and coupled (`pick_vocab_parallel`), plain temperature sampling (`sample_vocab_parallel`, and in a verify
    `verify_sampling_vocab_parallel`); top-k / top-p (a sort over the whole vocabulary) gather the logits."""
    return tp_group_of(policy) is not None and (params.greedy or (params.top_k == 0 and params.top_p == 1.0))


def pick_vocab_parallel(local: torch.Tensor, params, group, key: torch.Tensor | None = None,
                        pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or coupled token choice from this rank's vocabulary block of the logits, (B, W, V/tp) -> (tokens
    (B, W), log p (B, W) fp32), the whole-vocabulary rule's: greedy argmax(z) with log p the raw log_softmax;
    coupled argmax(z/T + G) (G = keyed_gumbel of the rows' keys `key` (B,) at positions `pos` (B, W), this block's
    ids only) with log p of the tempered distribution. argmax(log p + G) = argmax(z/T + G), the log-sum-exp being
    one constant per row (so the fp32 sums round differently from the whole path's: a tie within rounding may
    break the other way, as between a verify forward and a one-token step). Ties go to the lowest id, as
    torch.argmax's: the first rank holding the best score wins."""
    from .sampling import keyed_gumbel
    rank = dist.get_rank(group)
    n = local.shape[-1]
    z = local.float() if params.greedy else local.float() / params.temperature  # (B, W, n)
    score = z if params.greedy else z + keyed_gumbel(key, pos, n, start=rank * n)
    best, idx = score.max(-1)  # (B, W)
    m = z.max(-1).values
    stats = torch.stack([best.double(), (idx + rank * n).double(), z.gather(-1, idx[..., None])[..., 0].double(),
                         m.double(), (z - m[..., None]).exp().sum(-1).double()], dim=-1)  # (..., 5)
    allst = _gathered(stats, group, -2)  # (..., tp, 5)
    win = allst[..., 0].argmax(-1, keepdim=True)  # (..., 1): the first rank with the best score
    tok = allst[..., 1].gather(-1, win)[..., 0].long()
    z_tok = allst[..., 2].gather(-1, win)[..., 0]
    M = allst[..., 3].max(-1).values
    lse = M + (allst[..., 4] * (allst[..., 3] - M[..., None]).exp()).sum(-1).log()
    return tok, (z_tok - lse).float()


def _owner_value(local: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """local (..., n) at global ids (...), from the rank whose block holds each id (0 elsewhere, then summed)."""
    rank, n = dist.get_rank(group), local.shape[-1]
    mine = (ids >= rank * n) & (ids < (rank + 1) * n)
    idx = (ids - rank * n).clamp(0, n - 1)
    out = torch.where(mine, local.gather(-1, idx[..., None])[..., 0], local.new_zeros(()))
    dist.all_reduce(out, group=group)
    return out


def _gathered(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's `x`, stacked along a new `dim` in rank order (one all-gather)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts, dim)


def verify_sampling_vocab_parallel(local: torch.Tensor, temperature: float, q_draft: torch.Tensor,
                                   draft_tokens: torch.Tensor, u_accept: torch.Tensor, u_residual: torch.Tensor,
                                   group):
    """acceptance.verify_sampling_logits (plain temperature sampling) from this rank's vocabulary block of the
    target logits (B, k+1, V/tp): the same rule, p never gathered. q_draft (B, k, V) is the replicated draft's.

        lse_j                  each rank's (max, sum of exps) all-gathered                       (B, k+1, 2) x tp
        z(x̂_j), z(emitted)     the owner's value, 0 elsewhere, all-reduced (sum)                  (B, k) / (B, k+1)
        residual draw          each rank's residual mass all-gathered; the rank whose segment holds u·total draws
                               inside its block with the rescaled uniform, its token all-reduced (max of -1s)
    The inverse CDF runs per block, so its cumulative sums round differently from the whole vocabulary's: a
    uniform within ~1e-7 of a cdf boundary may land on the neighbouring token, as with the fused kernels."""
    from .acceptance import Verdict, _accept, _emit
    rank = dist.get_rank(group)
    B, k1, n = local.shape
    k = k1 - 1
    lse, _, _ = _lse_blocks(local, temperature, group)  # (B, k+1); no (B, k+1, n) fp32 copy of the logits
    z_x = _owner_value(local[:, :k], draft_tokens, group).float() / temperature
    p_x = (z_x - lse[:, :k]).exp()
    q_x = q_draft.gather(-1, draft_tokens[..., None])[..., 0]
    a = _accept(p_x, q_x, u_accept)  # (B,) the same on every rank (replicated inputs)
    rows = torch.arange(B, device=a.device)
    p_a = (local[rows, a].float() / temperature - lse[rows, a][:, None]).exp()  # (B, n): this block of p at a
    q_a = q_draft[rows, a.clamp(max=k - 1), rank * n:(rank + 1) * n] * (a < k)[:, None]
    residual = (p_a - q_a).clamp_min(0.0)
    masses = _gathered(torch.stack([residual.sum(-1), p_a.sum(-1)], -1), group, 1)  # (B, tp, 2)
    empty = masses[..., 0].sum(-1) <= 0  # p == q up to rounding: draw from p (acceptance.verify_sampling)
    residual = torch.where(empty[:, None], p_a, residual)
    seg = torch.where(empty[:, None], masses[..., 1], masses[..., 0])  # (B, tp) each block's share
    tokens = _emit(draft_tokens, a, _draw(residual, seg, u_residual, group))
    return Verdict(a, tokens), _owner_value(local, tokens, group).float() / temperature - lse


def _owner_point(seg: torch.Tensor, u: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse CDF's first step over blocks: given every block's total `seg` (B, tp) and uniforms u (B,), the
    block whose segment holds u·total (owner (B,)) and the uniform rescaled inside it (B,)."""
    tp = dist.get_world_size(group)
    cum = seg.cumsum(-1)
    target = u.to(cum.dtype) * cum[:, -1]
    owner = (cum <= target[:, None]).sum(-1).clamp(max=tp - 1)  # the first block whose segment ends past u·total
    before = torch.where(owner > 0, cum.gather(-1, (owner - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    u_in = ((target - before) / seg.gather(-1, owner[:, None])[:, 0].clamp_min(1e-30)).clamp(0, 1 - 1e-7)
    return owner, u_in


def _draw(weights: torch.Tensor, seg: torch.Tensor, u: torch.Tensor, group) -> torch.Tensor:
    """Inverse-CDF draw over the whole vocabulary from each rank's block of unnormalised weights (B, n), given every
    block's total `seg` (B, tp) and uniforms u (B,): the block whose segment holds u·total draws inside itself with
    the rescaled uniform (sampling.sample_from_probs), its token all-reduced to the others (max over -1s)."""
    from .sampling import sample_from_probs
    rank, n = dist.get_rank(group), weights.shape[-1]
    owner, u_in = _owner_point(seg, u, group)
    tok = sample_from_probs(weights, u_in) + rank * n  # (B,) meaningful on the owner only
    tok = torch.where(owner == rank, tok, torch.full_like(tok, -1))
    dist.all_reduce(tok, op=dist.ReduceOp.MAX, group=group)
    return tok


def _lse_blocks(local: torch.Tensor, temperature: float, group):
    """log-sum-exp of z = local / T over the whole vocabulary from (..., n) blocks: (lse (...), this block's own
    (...), every block's (..., tp)) fp32, one all-gather. Each block's by the fused kernel on CUDA (logits read once,
    no fp32 copy: ops/sampling_kernel.row_logsumexp), by torch elsewhere."""
    from ..ops.sampling_kernel import row_logsumexp, triton
    if local.is_cuda and triton is not None:
        flat = local.reshape(-1, local.shape[-1])
        own = row_logsumexp(flat if flat.stride(-1) == 1 else flat.contiguous(), 1.0 / temperature)
        own = own.view(local.shape[:-1])
    else:
        own = torch.logsumexp(local.float() / temperature, -1)
    every = _gathered(own, group, -1)  # (..., tp)
    return torch.logsumexp(every, -1), own, every


def sample_vocab_parallel(local: torch.Tensor, temperature: float, u: torch.Tensor, group
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain temperature sampling (no top-k / top-p) from this rank's block of the logits (B, V/tp) with the
    uniforms u (B,): (tokens (B,), log p (B,) fp32), sampling.pick_tokens_logp's inverse-CDF draw up to the
    blocks' rounding of the cumulative sums (as the fused kernel's). The blocks' masses come from their
    log-sum-exps (one all-gather of B numbers); the owner draws inside its block by pick_tokens_logp itself (the
    fused kernel on CUDA) with the rescaled uniform; its token and log-prob reach the others in one all-reduce."""
    from .sampling import SamplingParams, pick_tokens_logp
    rank, n = dist.get_rank(group), local.shape[-1]
    lse, own, every = _lse_blocks(local, temperature, group)  # (B,), (B,), (B, tp)
    owner, u_in = _owner_point((every - lse[:, None]).exp(), u, group)
    tok, logp = pick_tokens_logp(local, SamplingParams(temperature=temperature), u_in)  # inside this block
    mine = owner == rank
    both = torch.stack([torch.where(mine, tok + rank * n, 0).double(),
                        torch.where(mine, logp + own - lse, 0.0).double()], -1)  # (B, 2); ids exact in fp64
    dist.all_reduce(both, group=group)  # one owner per row: the sum is its values
    return both[:, 0].long(), both[:, 1].float()


def pick_one(local: torch.Tensor, params, group, key: torch.Tensor | None, pos: torch.Tensor,
             u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from this rank's block of the logits (B, V/tp) at positions `pos` (B,), by the sampler's
    vocabulary-parallel rule (`vocab_parallel` says when there is one): (tokens (B,), log p (B,) fp32). `key`: the
    rows' coupled-sampling keys; `u`: their uniforms for plain temperature sampling."""
    if params.greedy or params.keyed:
        tok, logp = pick_vocab_parallel(local[:, None], params, group, key, pos[:, None])
        return tok[:, 0], logp[:, 0]
    return sample_vocab_parallel(local, params.temperature, u, group)
