"""The baseline every rollout speedup is quoted against: a minimal, independent plain-PyTorch decoder
of the same shapes, compiled with torch.compile (inductor) and captured in a CUDA graph.

Written from scratch here (it shares no code with specco's engine), as a user would write a fast
decoder without a serving engine: fused qkv and gate/up linears, `nn.RMSNorm`, a RoPE table, cache
writes by slice assignment at a *Python-int* position (so every row sits at the same position and the
compiled graph is specialised to it), SDPA over the live prefix `cache[:, :, :pos + T]` with a small
(T, pos + T) causal mask, then the same inverse-CDF temperature sampling the engine does. It times one
step at a fixed position, which is all a baseline needs; it cannot serve ragged batches, so it is not
a rollout engine — that is exactly the gap specco's engine must close without being slower.

Qwen3's per-head q/k RMSNorm and an untied head follow the config. A mixture-of-experts MLP (Qwen3-MoE: router,
softmax over all experts in fp32, top-k, renormalised when norm_topk_prob) is written three ways a user might,
so the baseline is the best of them at each batch (`MOE_MODES`, bench/moe_verify.py times each):
  * "grouped": the N·k (token, expert) pairs sorted by expert and two grouped GEMMs (F.grouped_mm; Hopper, bf16);
  * "dense": every expert on every token, the unchosen weighted by zero (E/k times the FLOPs, every weight read);
  * "gather": each token's k experts' matrices gathered and multiplied per token (reads N·k expert copies).
`load_hf_state` takes weights from a Hugging Face-named state dict (specco's `Policy.state_dict()` is one), so
tests/test_bench_anchor.py can check the anchor computes the engine's function.

Also: `copy_bandwidth` (the ceiling for the read floor) measured in the same run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


MOE_MODES = ("grouped", "dense", "gather")


class _MoE(nn.Module):
    """Router + E SwiGLU experts (module docstring); `mode` picks how the experts run."""

    def __init__(self, h, E, top_k, inter, norm_topk_prob):
        super().__init__()
        self.top_k, self.norm, self.mode = top_k, norm_topk_prob, "grouped"
        self.router = nn.Linear(h, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(E, 2 * inter, h) * h ** -0.5)  # (E, 2I, h): [gate | up]
        self.w_down = nn.Parameter(torch.randn(E, h, inter) * inter ** -0.5)  # (E, h, I)

    def forward(self, x):
        shape, h = x.shape, x.shape[-1]
        x = x.reshape(-1, h)  # (N, h)
        p = self.router(x).float().softmax(-1)  # (N, E)
        w, idx = p.topk(self.top_k, -1)  # (N, k)
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        E, I = self.w_down.shape[0], self.w_down.shape[-1]
        if self.mode == "dense":
            full = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter(1, idx, w)  # (N, E)
            g, u = torch.einsum("nh,eih->eni", x, self.w_gate_up).split(I, -1)  # (E, N, I) each
            y = torch.einsum("eni,ehi->enh", F.silu(g) * u, self.w_down)  # (E, N, h)
            return (y * full.t()[:, :, None]).sum(0).reshape(shape)
        if self.mode == "gather":
            g, u = torch.einsum("nh,nkih->nki", x, self.w_gate_up[idx]).split(I, -1)  # (N, k, I) each
            y = torch.einsum("nki,nkhi->nkh", F.silu(g) * u, self.w_down[idx])  # (N, k, h)
            return (y * w[..., None]).sum(1).reshape(shape)
        flat = idx.reshape(-1)  # (N·k,)
        order = flat.argsort()  # pairs grouped by expert
        # (E,) segment ends; a scatter, not torch.bincount, which reads the largest id on the host (no CUDA graph)
        ends = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
        ends = ends.cumsum(0).to(torch.int32)
        xs = x[order // self.top_k]  # (N·k, h)
        g, u = F.grouped_mm(xs, self.w_gate_up.transpose(1, 2), offs=ends).split(I, -1)  # (N·k, I) each
        y = F.grouped_mm(F.silu(g) * u, self.w_down.transpose(1, 2), offs=ends)  # (N·k, h)
        y = y * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // self.top_k, y).reshape(shape)


class _Layer(nn.Module):
    def __init__(self, h, inter, H, Hkv, D, bias, eps, qk_norm=False, moe=None):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.ln1, self.ln2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (H + 2 * Hkv) * D, bias=bias)
        self.o = nn.Linear(H * D, h, bias=False)
        self.qn = nn.RMSNorm(D, eps=eps) if qk_norm else None
        self.kn = nn.RMSNorm(D, eps=eps) if qk_norm else None
        self.moe = _MoE(h, *moe) if moe else None
        if not moe:
            self.gate_up = nn.Linear(h, 2 * inter, bias=False)
            self.down = nn.Linear(inter, h, bias=False)

    def mlp(self, x):
        if self.moe is not None:
            return self.moe(x)
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


class AnchorDecoder(nn.Module):
    """Decoder-only transformer (Llama/Qwen2 layout) with a (L, B, Hkv, S, D) KV cache."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        h, D = cfg.hidden_size, cfg.head_dim
        self.embed = nn.Embedding(cfg.vocab_size, h)
        E = getattr(cfg, "num_experts", 0)
        moe = (E, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) if E else None
        self.layers = nn.ModuleList(_Layer(h, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, D,
                                           cfg.attention_bias, cfg.rms_norm_eps, getattr(cfg, "qk_norm", False), moe)
                                    for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", True):
            self.head.weight = self.embed.weight  # tied, as Qwen2.5-0.5B
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D)
        f = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv)
        self.register_buffer("cos", torch.cat([f, f], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([f, f], -1).sin(), persistent=False)

    def forward(self, tok, pos: int, k_cache, v_cache):
        """tok (B, T) at positions pos..pos+T-1 -> logits (B, T, V); writes the cache in place."""
        B, T = tok.shape
        x = self.embed(tok)
        cos, sin = (t[pos:pos + T, None].to(x.dtype) for t in (self.cos, self.sin))  # (T, 1, D): over heads
        S = pos + T
        mask = torch.ones(T, S, dtype=torch.bool, device=tok.device).tril(pos)  # query t sees keys <= pos+t
        for i, L in enumerate(self.layers):
            q, k, v = L.qkv(L.ln1(x)).view(B, T, -1, L.D).split([L.H, L.Hkv, L.Hkv], dim=2)
            if L.qn is not None:  # Qwen3: RMSNorm over each head's dims, before RoPE
                q, k = L.qn(q), L.kn(k)
            q, k = (torch.cat([-t[..., L.D // 2:], t[..., :L.D // 2]], -1) * sin + t * cos for t in (q, k))
            k_cache[i, :, :, pos:S] = k.transpose(1, 2)
            v_cache[i, :, :, pos:S] = v.transpose(1, 2)
            if T == 1:  # every live key is visible: no mask. GQA folded into the query dim, (B, Hkv,
                # G, D), so SDPA reads each kv head once with a fused kernel (`enable_gqa` went to the
                # math path on the H200 at B >= 32 and cost 3-18x)
                qf = q.view(B, L.Hkv, L.H // L.Hkv, L.D)
                o = F.scaled_dot_product_attention(qf, k_cache[i, :, :, :S], v_cache[i, :, :, :S])
                o = o.reshape(B, 1, L.H * L.D)
            else:  # the naive masked verify: T queries, a (T, S) mask, GQA by SDPA
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[i, :, :, :S], v_cache[i, :, :, :S],
                                                   attn_mask=mask, enable_gqa=True)
                o = o.transpose(1, 2).reshape(B, T, -1)
            x = x + L.o(o)
            x = x + L.mlp(L.ln2(x))
        return self.head(self.norm(x))

    def set_moe_mode(self, mode: str) -> None:
        for L in self.layers:
            if L.moe is not None:
                L.moe.mode = mode

    @torch.no_grad()
    def load_hf_state(self, sd: dict) -> None:
        """Weights from a Hugging Face-named state dict (`model.` prefixes dropped): q/k/v stacked into qkv, the
        experts' per-expert gate/up/down into the 3-D tensors."""
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        self.embed.weight.copy_(sd["embed_tokens.weight"])
        self.norm.weight.copy_(sd["norm.weight"])
        if "lm_head.weight" in sd and self.head.weight is not self.embed.weight:
            self.head.weight.copy_(sd["lm_head.weight"])
        for i, L in enumerate(self.layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            L.qkv.weight.copy_(torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]))
            if L.qkv.bias is not None:
                L.qkv.bias.copy_(torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"]))
            L.o.weight.copy_(sd[a + "o_proj.weight"])
            if L.qn is not None:
                L.qn.weight.copy_(sd[a + "q_norm.weight"])
                L.kn.weight.copy_(sd[a + "k_norm.weight"])
            L.ln1.weight.copy_(sd[p + "input_layernorm.weight"])
            L.ln2.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            m = p + "mlp."
            if L.moe is not None:
                L.moe.router.weight.copy_(sd[m + "gate.weight"])
                for e in range(L.moe.w_down.shape[0]):
                    x = f"{m}experts.{e}."
                    L.moe.w_gate_up[e].copy_(torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]]))
                    L.moe.w_down[e].copy_(sd[x + "down_proj.weight"])
            else:
                L.gate_up.weight.copy_(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]))
                L.down.weight.copy_(sd[m + "down_proj.weight"])


def sample(logits, u, temperature: float):
    """Inverse-CDF sampling of softmax(logits / T) with uniforms u (B,) — the engine's rule."""
    V = logits.shape[-1]
    cdf = (logits.reshape(-1, V).float() / temperature).softmax(-1).cumsum(-1)  # (B*T, V)
    tok = torch.searchsorted(cdf, (u.reshape(-1) * cdf[:, -1])[:, None]).clamp(max=V - 1)
    return tok.view(*logits.shape[:-1], 1)


@torch.no_grad()
def anchor_step_time(cfg, batch: int, pos: int, T: int, dtype, temperature: float, compile: bool,
                     timeit, moe_mode: str = "grouped") -> float:
    """Seconds per graphed step of T tokens per row at KV position `pos` (T = 1: a decode step;
    T = k+1: the naive masked verify), compiled with inductor when `compile`; a MoE config's experts run
    `moe_mode` (MOE_MODES)."""
    dev = "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        model = AnchorDecoder(cfg).to(dtype).eval()
        model.set_moe_mode(moe_mode)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, pos + T + 16, cfg.head_dim)
        k_cache, v_cache = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        tok = torch.randint(0, cfg.vocab_size, (batch, T))
        u = torch.rand(batch, T)
        out = torch.zeros(batch, T, 1, dtype=torch.long)

    # The forward is compiled; the sampling runs eagerly inside the same CUDA graph (inductor 2.11
    # failed to compile the cumsum-based sampler fused with the head for B·T > 1 on the H200).
    forward = torch.compile(model, fullgraph=True, dynamic=False) if compile else model

    def fn(tok, u):
        return sample(forward(tok, pos, k_cache, v_cache), u, temperature)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out.copy_(fn(tok, u))
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(fn(tok, u))
    t = timeit(g.replay, dev, iters=50, warmup=5)
    g = model = k_cache = v_cache = None  # freed (not `del`: fn above reads them; pyflakes flags a del)
    torch.cuda.empty_cache()
    return t


@torch.no_grad()
def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (the memory ceiling)."""
    from _timing import timeit
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = timeit(lambda: b.copy_(a), "cuda", iters=20, warmup=3)
    return nbytes / t
