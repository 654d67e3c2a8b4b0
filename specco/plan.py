"""`specco plan`: each rank's memory for every feasible layout of a run, before anything is launched.

    plan = plan_memory(cfg, gpus=64, gpu_gib=141, model="qwen3-32b")   # -> Plan(rows ranked, ...)
    print(format_plan(plan, top=10))

A layout is pp × dp_replicate × dp_shard × cp × tp = gpus (docs/DESIGN.md §9: the FSDP axis is dp_shard × cp; tp
the trainer's tensor parallelism, innermost), with or without activation checkpointing, and for a mixture-of-experts
policy an expert-parallel degree ep borrowed from the dp × cp ranks (plan_moe.py: the sparse layers' formulas); the
rollout engine's own tensor parallelism (rollout.tp, `engine_tp`) splits its policy and KV cache among the cp × tp
ranks of a DP group. Each component of a rank's memory is one function (one home per formula, its math in its
docstring): here the activations, the engine and the layouts, in plan_params.py the parameters and the state kept of
them, in plan_moe.py the sparse layers' own; `rank_memory` adds them for one layout. Parameter counts are exact: the
policy and draft are built on the meta device (no memory) and their parameters counted. Activation bytes are
counts of the tensors autograd saves for the backward, read off the code of model/layers.py, policy.py and moe.py,
in the dtype each is made in; tests/test_plan.py and test_plan_moe.py check them against the saved tensors and the
peak live bytes of a real co-training step. Everything is resident at once: the trainer's state, its activations at
the step's peak (the start of the policy's backward) and the colocated rollout engine's weights and KV cache (no
offload yet).

Not modelled (why the fits column keeps `reserve_gib` free): the CUDA context and NCCL buffers (~1-2 GiB),
the caching allocator's fragmentation, kernels' workspaces, compiled graphs' pools, a second kept decode runner
(rollout.cache_runners > 1 without rollout.cache_gib), the PPO log-prob recompute (no-grad, transient).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import torch

from .config import BLOCK_KINDS, RunConfig
from .model.config import ConfigError, PolicyConfig
from .plan_moe import (active_params, ep_degrees, expert_params, held_expert_params, moe_activation_bytes,
                       moe_layout_runs, router_aux_bytes, router_aux_step_bytes, sparse_layers)
from .plan_params import (adamw_bytes, compute_copy_bytes, draft_params, engine_params, grad_bytes, master_bytes,
                          policy_params, rank_params, reference_bytes)

GiB = 2**30
CP_MIN_TOKENS = 1024  # CP only when every rank keeps >= this many tokens of a row: below, the ring's
# transfers cannot hide behind the attention (and zigzag needs 2·cp chunks of a row)

# Published shapes (each model's Hugging Face config.json) for the README's tables; `--model NAME`.
PRESETS = {
    # Qwen/Qwen3-8B config.json: 8.19 B parameters
    "qwen3-8b": PolicyConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                             num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, model_type="qwen3"),
    # Qwen/Qwen3-32B config.json: 32.8 B parameters
    "qwen3-32b": PolicyConfig(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
                              num_heads=64, num_kv_heads=8, head_dim=128, qk_norm=True, model_type="qwen3"),
    # a 120B-class dense model: mistralai/Mistral-Large-Instruct-2407 config.json (123 B parameters, a
    # Llama-style decoder: GQA 96/8 heads of 128, SwiGLU, untied 32,768-token head)
    "dense-120b": PolicyConfig(vocab_size=32768, hidden_size=12288, intermediate_size=28672, num_layers=88,
                               num_heads=96, num_kv_heads=8, head_dim=128, model_type="llama"),
    # Qwen/Qwen3-30B-A3B config.json: 30.53 B parameters, 3.35 B active (48 sparse layers of 128 experts of width
    # 768, top 8). Not transformers' Qwen3MoeConfig() defaults: those have 24 layers, head_dim hidden/heads = 64
    # and norm_topk_prob false; intermediate_size 6144 is unused (no dense layer) but sizes the EAGLE-3 draft's MLP
    "qwen3-30b-a3b": PolicyConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                                  num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, model_type="qwen3_moe",
                                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                  norm_topk_prob=True, router_aux_loss_coef=0.001),
}


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    fsdp: bool  # the policy sharded over dp_shard × cp (else every dp × cp rank holds it whole)
    ac: bool  # activation checkpointing of the policy's layers
    tp: int = 1  # the trainer's tensor parallelism (parallel.tp): layer projections and head rows split tp ways
    ep: int = 1  # expert parallelism (parallel.ep): each sparse layer's experts cut ep ways (plan_moe.experts_held)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks one copy of the policy's fp32 state is sharded over: the FSDP axis dp_shard × cp."""
        return self.dp_shard * self.cp if self.fsdp else 1

    def name(self) -> str:
        return (f"pp{self.pp} rep{self.dp_replicate} shard{self.dp_shard} cp{self.cp}"
                f"{f' tp{self.tp}' if self.tp > 1 else ''}{f' ep{self.ep}' if self.ep > 1 else ''}"
                f"{'' if self.fsdp else ' nofsdp'}{' ac' if self.ac else ''}")


@dataclass(frozen=True)
class Shapes:
    """What the formulas read, resolved once from the run config (sizes per rank, bytes per element)."""
    policy: PolicyConfig
    draft_kind: str | None  # None: no co-trained draft
    draft_vocab: int
    draft_layers: int  # block drafters' decoder layers (EAGLE-3: 1)
    num_taps: int
    seq: int  # prompt + max_new_tokens: the longest trained row
    rows_per_step: int  # rollout rows of one RL step (all ranks)
    minibatches: int
    micro_batch_rows: int  # 0: the whole minibatch
    draft_row_stride: int
    ttt_passes: int
    gamma: int  # tokens per draft round (rollout.k)
    num_anchors: int
    loss_chunk: int
    compute_bytes: int  # matmul outputs: 2 under bf16 autocast, else 4
    engine_bytes: int  # the rollout engine's copy (rollout.dtype)
    compact_below: float
    kl_reference: bool = False  # train.kl_coef > 0: the frozen starting policy is kept as the KL reference
    moe_aux: bool = False  # a MoE policy's router aux loss weight > 0: its softmax kept per sparse layer
    shortest_prompt: int = 0  # known shortest prompt (a lookup workload's ledger), 0: unknown (no cut counted)
    shared_group: int = 0  # train.share_prompts: rollout.group_size (rows per packed group), else 0
    prompt: int = 0  # the longest prompt (a packed group's shared prefix, under shared_group)
    width_multiple: int = 1  # train.width_multiple: a packed group's prefix is rounded down to a multiple of it


def _bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def policy_config(cfg: RunConfig, model: str | None = None) -> PolicyConfig:
    """The policy's shape: a preset (`model`), the config.json of policy.source when it is a directory, or the
    tiny policy's sizes (its vocabulary: the character tokenizer's)."""
    if model:
        if model not in PRESETS:
            raise ConfigError(f"--model {model!r}: use one of {', '.join(PRESETS)}")
        return PRESETS[model]
    src = cfg.policy.source
    if src in ("", "tiny"):
        from .data.tokenizer import build_char_tokenizer
        from .runner.derive import tiny_policy
        pc = tiny_policy(cfg, build_char_tokenizer())
    else:
        from .model.hf_io import load_policy_config
        try:
            pc = load_policy_config(src)
        except FileNotFoundError as e:
            raise ConfigError(f"policy.source={src!r}: no config.json to read the shape from ({e}); pass "
                              f"--model {'|'.join(PRESETS)} for a published shape") from None
    return pc


def shapes(cfg: RunConfig, pc: PolicyConfig, prompt_tokens: int, device: str = "cuda") -> Shapes:
    """The formulas' inputs from the run config, with "auto" precision decided as a run on `device` would."""
    from .runner.derive import on_device
    cfg = on_device(cfg, torch.device(device))
    mode_kinds = [a.partition("-") for a in cfg.arms]
    cotrained = [k or cfg.draft.kind for m, _, k in mode_kinds if m in ("cotrained", "cold")]
    kind = cotrained[0] if cotrained else None
    d = cfg.draft
    vocab = pc.vocab_size if kind in BLOCK_KINDS else (
        min(d.draft_vocab_size, pc.vocab_size) if d.draft_vocab_size else (pc.vocab_size if pc.vocab_size <= 8192 else 4096))
    r, t = cfg.rollout, cfg.train
    aux = pc.router_aux_loss_coef if cfg.policy.router_aux_loss_coef is None else cfg.policy.router_aux_loss_coef
    gamma = (r.block_k or r.k) if kind in BLOCK_KINDS else r.k
    return Shapes(policy=pc, draft_kind=kind, draft_vocab=vocab, draft_layers=d.block_layers or 1,
                  num_taps=len(d.aux_layer_ids) or len(set(_default_taps(pc.num_layers))),
                  seq=prompt_tokens + r.max_new_tokens, rows_per_step=r.prompts_per_step * r.group_size,
                  minibatches=t.minibatches, micro_batch_rows=t.micro_batch_rows, draft_row_stride=t.draft_row_stride,
                  ttt_passes=d.ttt_passes, gamma=gamma, num_anchors=d.num_anchors or 16, loss_chunk=t.loss_chunk,
                  compute_bytes=2 if t.amp == "bf16" else _bytes(cfg.policy.dtype),
                  engine_bytes=_bytes(cfg.rollout.dtype or cfg.policy.dtype), compact_below=r.compact_below,
                  kl_reference=t.kl_coef > 0, moe_aux=pc.moe and aux > 0,
                  shortest_prompt=cfg.data.context_tokens[0] if cfg.data.context_tokens else 0,
                  shared_group=r.group_size if t.share_prompts else 0, prompt=prompt_tokens,
                  width_multiple=t.width_multiple)


def _default_taps(num_layers: int):
    from .model.config import aux_layer_ids_default
    return aux_layer_ids_default(num_layers)


# -- activations -----------------------------------------------------------------------------------------------

def layer_activation_bytes(pc: PolicyConfig, c: int, r: int, tp: int = 1, mlp: int | None = None) -> int:
    """Bytes one decoder layer saves for its backward, per token: what autograd keeps of DecoderLayer.forward
    (checked to the byte in fp32, under bf16 autocast and over bf16 parameters, tests/test_plan.py).

    r = the residual stream's bytes (the parameters' compute dtype: 4 over fp32 weights, 2 under FSDP's bf16
    params), c = matmul outputs' (2 under bf16 autocast, else r). With q = H·D, kv = Hkv·D, I = intermediate:
        2h·4            each RMSNorm's x in fp32 (the normalisation runs in fp32): the layer's input and the
                        mid-layer residual themselves when r = 4, else their fp32 copies (the r-byte x is not kept)
        2·norm(h)       each RMSNorm (ops/decode_kernels.rms_norm_reference): x/rms in r, the matmul's input in c
                        (the weighted output itself, or autocast's copy of it) and the fp32 1/rms
        (q+2kv)·c       the fused qkv output (v is a view of it, saved by the attention)
        (q+kv)·c        q and k after RoPE as the attention saves them (autocast's copies when c < r)
        qk-norm (Qwen3) (q+kv)·c for q/rms, k/rms, + their fp32 copies when c < 4, + 4·(H+Hkv) for the 1/rms
        q·c + 4H        the attention output (o_proj reads it as a view) and the softmax's fp32 log-sum-exp
        4I·c            the fused gate|up output (2I; silu and the product read views of it), silu(gate), silu·up
    The (S, S) scores are never kept: SDPA's flash / memory-efficient kernels save only the log-sum-exp.
    Under tensor parallelism (tp, without sequence parallelism) a rank holds H/tp heads, Hkv/tp kv heads and I/tp
    MLP rows, so every term past the residual stream and its norms (whole on every rank) divides by tp.
    mlp: a sparse layer's bytes per token in place of the SwiGLU's 4I·c (plan_moe.moe_activation_bytes; tp 1)."""
    h, q, kv, I, H = pc.hidden_size, pc.num_heads * pc.head_dim, pc.num_kv_heads * pc.head_dim, \
        pc.intermediate_size, pc.num_heads
    norm = h * (r + c) + 4
    qk = ((q + kv) * (c + (4 if c < 4 else 0)) + 4 * (H + pc.num_kv_heads)) if pc.qk_norm else 0
    split = (q + 2 * kv) * c + (q + kv) * c + qk + q * c + 4 * H + (4 * I * c if mlp is None else 0)
    return 2 * h * 4 + 2 * norm + split // tp + (mlp or 0)


def logits_bytes(pc: PolicyConfig, c: int, tp: int = 1) -> int:
    """Per token, the policy loss's vocabulary-sized tensors in its backward: train/losses.token_logprobs (and its
    loss-parallel form under tensor parallelism, parallel/tp.vocab_parallel_logprobs, on a rank's V/tp columns) keeps
    only the logits (c) and forms their gradient (c) a chunk of positions at a time (its fp32 chunk work is bounded,
    LOGPROB_CHUNK_ELEMENTS, not per token)."""
    return pc.vocab_size // tp * 2 * c


def draft_activation_bytes(s: Shapes, c: int, r: int) -> int:
    """Per trained draft row-token, what the draft's loss keeps until its backward.

    EAGLE-3 (model/ttt.py, train/losses.py): K passes, each one draft decoder layer over 2h inputs
    (≈ a policy layer + the 2h concat and its two norms, + the branch K/V stacks (d-1)·2kv), plus the teacher:
    logits[..., d2t] and its K shifted copies, (K+1)·Vd·c (the CE chunks are checkpointed: only loss_chunk
    tokens of fp32 (.., Vd) work live at once, not counted). Block drafters (model/dflash.py): per row-token the
    trunk (h + 2kv per layer), per anchor W slot-tokens through L_d layers, their logits over V chunked."""
    pc = s.policy
    h, kv = pc.hidden_size, pc.num_kv_heads * pc.head_dim
    layer = layer_activation_bytes(dataclasses.replace(pc, qk_norm=False), c, r)
    if s.draft_kind in BLOCK_KINDS:
        W = s.gamma + (1 if s.draft_kind == "dflash" else 0)
        per_anchor = W * s.draft_layers * layer
        return s.draft_layers * (h + 2 * kv) * r + math.ceil(s.num_anchors * per_anchor / max(s.seq, 1))
    K = s.ttt_passes
    passes = K * (layer + 2 * h * r + 2 * h * r) + sum(d - 1 for d in range(1, K + 1)) * 2 * kv * r
    return passes + (K + 1) * s.draft_vocab * c


def micro_rows(s: Shapes, lay: Layout) -> tuple[int, int]:
    """(rows of one micro-batch, micro-batches per optimizer step) on one data-parallel rank."""
    per_rank = max(1, s.rows_per_step // lay.dp // s.minibatches)
    m = s.micro_batch_rows if 0 < s.micro_batch_rows < per_rank else per_rank
    return m, math.ceil(per_rank / m)


def activation_bytes(s: Shapes, lay: Layout, layers: range, last: bool, in_flight: int) -> int:
    """A stage's activations at the start of its backward: `in_flight` micro-batches of b rows × seq/cp tokens
    (1F1B keeps min(pp - stage, micro-batches) in flight). Without checkpointing every layer's saved tensors;
    with it, each layer's input (h·r) and one layer's recomputed tensors (the larger kind, dense or sparse). The
    router's aux loss keeps its softmax per sparse layer either way, and a few vectors per micro-batch. The last
    stage adds the embedding taps (k·h·r, the concat), the logits and the draft (on every stride-th row)."""
    pc, c = s.policy, s.compute_bytes
    r = 2 if (lay.fsdp and c == 2) else 4
    b, _ = micro_rows(s, lay)
    tokens = policy_tokens(s, lay, b)
    n_sparse = sparse_layers(pc, layers)
    dense = layer_activation_bytes(pc, c, r, lay.tp)
    sparse = layer_activation_bytes(pc, c, r, lay.tp, moe_activation_bytes(pc, c, r, lay.ep)) if n_sparse else 0
    kept = n_sparse * router_aux_bytes(pc) if s.moe_aux else 0  # outside the layers: checkpointing keeps it
    n_dense = len(layers) - n_sparse
    if lay.ac:
        body = len(layers) * pc.hidden_size * r + max(dense if n_dense else 0, sparse) + kept
    else:
        body = n_dense * dense + n_sparse * sparse + kept
    total = in_flight * tokens * (body + pc.hidden_size * r)  # + the final norm's / embedding's output
    if s.moe_aux and n_sparse:  # + the aux loss's once per micro-batch
        total += in_flight * router_aux_step_bytes(pc, tokens)
    if last:  # the draft is whole on every tp rank (replicated), its taps gathered whole
        cut = loss_columns(s, lay)
        # packed groups: each group's columns but its prefix's before the cut (shared_prompts's logits_from)
        columns = (tokens - math.ceil(b / s.shared_group) * (math.ceil(s.seq / lay.cp) - cut) if s.shared_group
                   else b * cut)
        total += columns * logits_bytes(pc, c, lay.tp)
        if s.draft_kind is not None:
            d_rows = math.ceil(b / s.draft_row_stride)
            total += tokens * s.num_taps * pc.hidden_size * r
            if s.shared_group:  # the taps and teacher logits unpacked to the rows, beside the packed ones
                total += b * (math.ceil(s.seq / lay.cp) * s.num_taps * pc.hidden_size * r
                              + cut * logits_bytes(pc, c, lay.tp))
            if s.draft_kind in BLOCK_KINDS:
                total += d_rows * math.ceil(s.seq / lay.cp) * draft_activation_bytes(s, c, r)
            else:  # EAGLE-3's passes from the cut on; pass 1's input and K/V (the trunk) at every position
                kv = pc.num_kv_heads * pc.head_dim
                trunk = (4 * pc.hidden_size + 2 * kv) * r
                total += d_rows * (math.ceil(s.seq / lay.cp) * trunk + cut * draft_activation_bytes(s, c, r))
    return total


def policy_tokens(s: Shapes, lay: Layout, b: int) -> int:
    """Tokens of one micro-batch of `b` rows in the policy's forward: b x seq/cp; under train.share_prompts
    (parallel/shared_prompts.py) its ceil(b / G) prompt groups packed, each the prompt's first p tokens once and G
    segments of the prompt's rest and a completion (P: the longest prompt, G: the group size, p: P - 1 rounded down
    to a multiple of train.width_multiple)."""
    if not s.shared_group:
        return b * math.ceil(s.seq / lay.cp)
    p = (s.prompt - 1) // s.width_multiple * s.width_multiple
    return math.ceil(b / s.shared_group) * (p + s.shared_group * (s.seq - p))


def loss_columns(s: Shapes, lay: Layout) -> int:
    """The columns of a micro-batch the losses read: the step makes logits, and runs EAGLE-3's passes, only from its
    first trained column minus K+1 (train/drafters.first_anchor), so a known shortest prompt is cut off; under CP or
    TP every position of the rank's share (their layouts take the whole row)."""
    whole = math.ceil(s.seq / lay.cp)
    if lay.cp > 1 or lay.tp > 1 or not s.shortest_prompt:
        return whole
    return max(1, min(whole, s.seq - max(0, s.shortest_prompt - s.ttt_passes - 1)))


# -- the rollout engine ----------------------------------------------------------------------------------------

def engine_rows(s: Shapes, lay: Layout) -> int:
    """Rows one rank's engine decodes per step: its data-parallel share of prompts × group_size."""
    return max(1, s.rows_per_step // lay.dp)


def kv_cache_bytes(s: Shapes, lay: Layout, engine_tp: int = 1) -> int:
    """rows × (seq + γ+1 slack) × (L/engine_tp + draft layers) × 2 (K, V) × Hkv × D × engine bytes, × (1 +
    2·compact_below) for the compacted levels (powers of two below compact_below of the rows: their sum <
    2·compact_below·rows). A tensor-parallel engine (rollout.tp) decodes its DP group's rows with the policy's kv
    heads split engine_tp ways (rollout/tp.py); the draft's own cache is whole on every rank."""
    pc = s.policy
    draft_layers = 0 if s.draft_kind is None else s.draft_layers
    per_token = (pc.num_layers * pc.num_kv_heads // engine_tp + draft_layers * pc.num_kv_heads) * 2 * pc.head_dim \
        * s.engine_bytes
    return int(engine_rows(s, lay) * (s.seq + s.gamma + 1) * per_token * (1 + 2 * s.compact_below))


def engine_weight_bytes(s: Shapes, engine_tp: int = 1) -> int:
    """The engine's policy and draft in rollout dtype: with rollout.tp = engine_tp, its shard of the policy
    (plan_params.engine_params: projections, every expert's SwiGLU and head rows / tp, the embedding, norms and
    routers whole) and the whole draft. A MoE engine holds every expert (the refit gathers them)."""
    return s.engine_bytes * (engine_params(s.policy, engine_tp) + draft_params(s))


# -- one layout, every layout ----------------------------------------------------------------------------------

COLUMNS = ("params", "compute", "grads", "adamw", "acts", "draft", "ref", "engine_w", "kv_cache", "total")


def peak_bytes(m: dict[str, int], offload: bool) -> int:
    """A rank's peak: everything at once for a colocated engine; with the engine's weights and KV cache released
    to the host while the trainer runs (`--offload`, issue 34 item 5, as colocated vLLM's sleep mode), the larger
    of the train step (all but the engine) and the rollout (the trainer's weights and AdamW state, no gradients
    or activations, beside the engine)."""
    if not offload:
        return sum(v for k, v in m.items() if k != "total")
    train = sum(m[k] for k in ("params", "compute", "grads", "adamw", "acts", "draft", "ref"))
    rollout = m["params"] + m["adamw"] + m["draft"] * 12 // 16 + m["ref"] + m["engine_w"] + m["kv_cache"]
    return max(train, rollout)


def rank_memory(s: Shapes, lay: Layout, offload: bool = False, engine_tp: int = 1) -> dict[str, int]:
    """Bytes per component on the fullest rank of `lay` (the max over pipeline stages of the total)."""
    from .parallel.pipeline import stage_layer_ranges
    pc, c = s.policy, s.compute_bytes
    _, n_micro = micro_rows(s, lay)
    best = None
    for stage, rng in enumerate(stage_layer_ranges(pc.num_layers, lay.pp)):
        first, last = stage == 0, stage == lay.pp - 1
        in_flight = min(lay.pp - stage, n_micro)
        P = rank_params(pc, rng, first, last, lay.tp) - expert_params(pc, rng)  # all but the experts: FSDP shards it
        X = held_expert_params(pc, rng, lay)  # the experts whose state the rank keeps (plan_moe.experts_held)
        D = draft_params(s) if last else 0
        rows = engine_rows(s, lay)
        m = {"params": master_bytes(P, lay, X), "compute": compute_copy_bytes(pc, rng, first, last, lay, c, in_flight),
             "grads": grad_bytes(P, lay, X), "adamw": adamw_bytes(P, lay, X),
             "acts": activation_bytes(s, lay, rng, last, in_flight),
             # the draft is replicated (parallel/fsdp.py): fp32 weights, gradients, AdamW (16 B/param) + autocast copy
             "draft": D * (16 + (2 if c < 4 else 0)), "ref": reference_bytes(s, lay, rng, first, last),
             "engine_w": engine_weight_bytes(s, engine_tp) + rows * (s.gamma + 1) * pc.vocab_size * 4,
             "kv_cache": kv_cache_bytes(s, lay, engine_tp)}
        m["total"] = peak_bytes(m, offload)
        if best is None or m["total"] > best["total"]:
            best = m
    return best


def tp_divides(pc: PolicyConfig, tp: int, engine: bool = False) -> bool:
    """Whether tp splits the policy's heads, kv heads, MLP width and vocabulary (runner/derive.check_tp_sizes);
    the engine's (rollout.tp, `engine`) also a MoE's expert and shared-expert widths (rollout/tp.tp_shard)."""
    widths = (pc.moe_intermediate_size, pc.shared_expert_intermediate_size) if engine and pc.moe else ()
    return all(n % tp == 0 for n in (pc.num_heads, pc.num_kv_heads, pc.intermediate_size, pc.vocab_size, *widths))


def layouts(s: Shapes, gpus: int, ac: tuple[bool, ...] = (False, True), engine_tp: int = 1) -> list[Layout]:
    """Every pp × dp_replicate × dp_shard × cp × tp = gpus with pp | num_layers, cp only while each rank keeps
    >= CP_MIN_TOKENS of a row, tp dividing the policy's sizes, engine_tp dividing cp × tp (the ranks that share a DP
    group's rollouts: under PP each stage's engine is such a shard), the step's prompts
    divisible into whole groups per data-parallel rank; FSDP on whenever dp_shard × cp > 1 (plus the unsharded
    layout dp_shard = 1). A MoE policy's layouts add each ep of
    plan_moe.ep_degrees and keep those the trainer runs (plan_moe.moe_layout_runs); a dense policy's have ep 1."""
    out = []
    divs = [d for d in range(1, gpus + 1) if gpus % d == 0]
    prompts = s.rows_per_step  # rows; a rank needs whole groups, checked through prompts below
    for pp in divs:
        if s.policy.num_layers % pp:
            continue
        for tp in divs:
            if (gpus // pp) % tp or not tp_divides(s.policy, tp):
                continue
            for cp in divs:
                if (gpus // (pp * tp)) % cp or (cp > 1 and s.seq < cp * CP_MIN_TOKENS) or (cp * tp) % engine_tp:
                    continue
                dp = gpus // (pp * cp * tp)
                if prompts % dp:
                    continue
                for shard in (d for d in divs if dp % d == 0):
                    for fsdp in ((False, True) if shard == 1 else (True,)):
                        if fsdp and shard * cp == 1:
                            continue
                        for ep in ep_degrees(s.policy, dp * cp):
                            lay = Layout(pp, dp // shard, shard, cp, fsdp, False, tp, ep)
                            if moe_layout_runs(s.policy, lay):
                                out += [dataclasses.replace(lay, ac=a) for a in ac]
    return out


@dataclass
class Plan:
    gpus: int
    gpu_gib: float
    reserve_gib: float
    shapes: Shapes
    offload: bool = False
    engine_tp: int = 1
    rows: list[tuple[Layout, dict[str, int]]] = field(default_factory=list)

    def headroom(self, mem: dict[str, int]) -> float:
        return self.gpu_gib - self.reserve_gib - mem["total"] / GiB

    def to_json(self) -> dict:
        s = self.shapes
        total = policy_params(s.policy)
        return {"gpus": self.gpus, "gpu_gib": self.gpu_gib, "reserve_gib": self.reserve_gib, "offload": self.offload,
                "engine_tp": self.engine_tp, "policy_params": total,
                "policy_active_params": active_params(s.policy, total), "draft_params": draft_params(s), "seq": s.seq,
                "layouts": [{**dataclasses.asdict(lay), **{k: v / GiB for k, v in m.items()},
                             "headroom_gib": self.headroom(m), "fits": self.headroom(m) >= 0} for lay, m in self.rows]}


def longest_prompt(cfg: RunConfig) -> int:
    """The longest prompt the planner assumes without --prompt-tokens: data.max_prompt_tokens; else a lookup
    workload's longest ledger (data.context_tokens' upper end, +1 for <bos>: the char tokenizer's token per
    character); else 512."""
    d = cfg.data
    if d.max_prompt_tokens:
        return d.max_prompt_tokens
    return d.context_tokens[-1] + 1 if d.context_tokens else 512


def plan_memory(cfg: RunConfig, gpus: int, gpu_gib: float, *, model: str | None = None, prompt_tokens: int = 0,
                reserve_gib: float = 4.0, ac: tuple[bool, ...] = (False, True), offload: bool = False,
                engine_tp: int | None = None) -> Plan:
    """Every feasible layout of `cfg` on `gpus` GPUs of `gpu_gib` GiB, fitting ones first, most headroom first, then
    the least memory over both phases (a fitting layout that needs less sharding comes later: fewer collectives are a
    choice left to the user).
    prompt_tokens: the longest prompt (0: `longest_prompt(cfg)`). engine_tp: the engine's tensor parallelism (None:
    the config's rollout.tp)."""
    engine_tp = cfg.rollout.tp if engine_tp is None else engine_tp
    if gpus < 1 or gpu_gib <= 0:
        raise ConfigError(f"--gpus {gpus} --gpu-mem {gpu_gib}: need >= 1 GPU of > 0 GiB")
    pc = policy_config(cfg, model)
    s = shapes(cfg, pc, prompt_tokens or longest_prompt(cfg))
    if engine_tp < 1 or not tp_divides(pc, engine_tp, engine=True):
        moe = (f", {pc.moe_intermediate_size} expert width" if pc.moe else "") + (
            f", {pc.shared_expert_intermediate_size} shared-expert width" if pc.shared_expert_intermediate_size else "")
        raise ConfigError(f"--engine-tp {engine_tp} (rollout.tp): must divide the policy's {pc.num_heads} heads, "
                          f"{pc.num_kv_heads} kv heads, {pc.intermediate_size} MLP width, {pc.vocab_size} "
                          f"vocabulary{moe}")
    plan = Plan(gpus, gpu_gib, reserve_gib, s, offload, engine_tp)
    lays = layouts(s, gpus, ac, engine_tp)
    if not lays:
        raise ConfigError(f"no layout of {gpus} GPUs: rollout.prompts_per_step × group_size = {s.rows_per_step} rows "
                          f"split over no data-parallel degree dividing {gpus}"
                          + (f", with --engine-tp {engine_tp} dividing cp × tp" if engine_tp > 1 else ""))
    # ties (an offloaded peak is often the rollout phase, the same for many layouts): the smaller sum of all first
    plan.rows = sorted(((lay, rank_memory(s, lay, offload, engine_tp)) for lay in lays),
                       key=lambda x: (-plan.headroom(x[1]), sum(v for k, v in x[1].items() if k != "total")))
    return plan


def format_plan(plan: Plan, top: int = 0) -> str:
    """The table: one line per layout, GiB per component, total, headroom and fits."""
    s = plan.shapes
    total = policy_params(s.policy)
    active = f" ({active_params(s.policy, total) / 1e9:.2f} B active)" if s.policy.moe else ""
    head = (f"policy {total / 1e9:.2f} B params{active}, draft {s.draft_kind or 'none'} "
            f"{draft_params(s) / 1e9:.2f} B; seq {s.seq}, {s.rows_per_step} rows/step, micro-batch "
            f"{s.micro_batch_rows or 'whole'}; {plan.gpus} x {plan.gpu_gib:g} GiB, {plan.reserve_gib:g} GiB reserved"
            f"{'; engine offloaded while training' if plan.offload else ''}"
            f"{f'; engine tp {plan.engine_tp}' if plan.engine_tp > 1 else ''}")
    cols = f"{'layout':<34}" + "".join(f"{c:>9}" for c in COLUMNS) + f"{'headroom':>9} fits"
    lines = [head, cols]
    for lay, m in plan.rows[:top or None]:
        lines.append(f"{lay.name():<34}" + "".join(f"{m[c] / GiB:>9.1f}" for c in COLUMNS)
                     + f"{plan.headroom(m):>9.1f} {'yes' if plan.headroom(m) >= 0 else 'no'}")
    return "\n".join(lines)


def write_json(plan: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump(plan.to_json(), f, indent=1)
