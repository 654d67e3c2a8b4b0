"""The baseline every rollout speedup is quoted against: a minimal, independent plain-PyTorch decoder
of the same shapes, compiled with torch.compile (inductor) and captured in a CUDA graph.

Written from scratch here (it shares no code with specco's engine), as a user would write a fast
decoder without a serving engine: fused qkv and gate/up linears, `nn.RMSNorm`, a RoPE table, cache
writes by slice assignment at a *Python-int* position (so every row sits at the same position and the
compiled graph is specialised to it), SDPA over the live prefix `cache[:, :, :pos + T]` with a small
(T, pos + T) causal mask, then the same inverse-CDF temperature sampling the engine does. It times one
step at a fixed position, which is all a baseline needs; it cannot serve ragged batches, so it is not
a rollout engine — that is exactly the gap specco's engine must close without being slower.

Also: `copy_bandwidth` (the ceiling for the read floor) measured in the same run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Layer(nn.Module):
    def __init__(self, h, inter, H, Hkv, D, bias, eps):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.ln1, self.ln2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (H + 2 * Hkv) * D, bias=bias)
        self.o = nn.Linear(H * D, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)


class AnchorDecoder(nn.Module):
    """Decoder-only transformer (Llama/Qwen2 layout) with a (L, B, Hkv, S, D) KV cache."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        h, D = cfg.hidden_size, cfg.head_dim
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(_Layer(h, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, D,
                                           cfg.attention_bias, cfg.rms_norm_eps) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
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
            g, u = L.gate_up(L.ln2(x)).chunk(2, -1)
            x = x + L.down(F.silu(g) * u)
        return self.head(self.norm(x))


def sample(logits, u, temperature: float):
    """Inverse-CDF sampling of softmax(logits / T) with uniforms u (B,) — the engine's rule."""
    V = logits.shape[-1]
    cdf = (logits.reshape(-1, V).float() / temperature).softmax(-1).cumsum(-1)  # (B*T, V)
    tok = torch.searchsorted(cdf, (u.reshape(-1) * cdf[:, -1])[:, None]).clamp(max=V - 1)
    return tok.view(*logits.shape[:-1], 1)


@torch.no_grad()
def anchor_step_time(cfg, batch: int, pos: int, T: int, dtype, temperature: float, compile: bool,
                     timeit) -> float:
    """Seconds per graphed step of T tokens per row at KV position `pos` (T = 1: a decode step;
    T = k+1: the naive masked verify), compiled with inductor when `compile`."""
    dev = "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        model = AnchorDecoder(cfg).to(dtype).eval()
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
