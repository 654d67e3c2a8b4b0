"""bench/moe_verify.py on CPU at a tiny size (fp32, eager): the JSON has every field the GPU run fills, and the parts
that are not timings hold. No timing is asserted (CPU timings of a tiny model mean nothing).

* experts touched, per MoE layer: top_k <= count <= min(E, n·top_k) for n routed tokens, and a verify's count >= the
  plain step's (its first token per row is the step's token, so its routed set contains the step's);
* the dense twin's active parameters equal the MoE's: active_moe = total_moe − L·((E − top_k)·3·h·I + h·E) and
  active_dense = total_dense, both totals equal to PolicyConfig.num_params (config.py's own count);
* the floor's weight bytes are recounted here from a Policy of the JSON's config (real parameter sizes: attention,
  norms, head, dense MLP, or router + touched experts), its KV bytes from a real cache's tensors, and
  floor_ms = (weight + KV bytes) / the run's bandwidth."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

TINY = dict(hidden=64, layers=2, experts=8, top_k=2, moe_inter=32, heads=4, kv_heads=2, vocab=256)
BATCHES, KV, KS = (1, 4), 16, (1, 3)


def _run(tmp_path) -> dict:
    out = tmp_path / "moe_verify.json"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_verify.py"), "--device", "cpu", *args,
                        "--batches", ",".join(map(str, BATCHES)), "--kv", str(KV), "--ks", ",".join(map(str, KS)),
                        "--rounds", "1", "--iters", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| B | model |" in p.stdout  # the markdown table
    return json.loads(out.read_text())


def test_moe_verify_bench(tmp_path):
    from specco.model.config import PolicyConfig
    from specco.model.policy import Policy
    r = _run(tmp_path)
    E, top_k, h, I, L = TINY["experts"], TINY["top_k"], TINY["hidden"], TINY["moe_inter"], TINY["layers"]
    names = ["step"] + [f"verify_k{k}" for k in KS]

    # active parameters: the twin's definition, by the formula and by config.py's count
    cfgs = {m: PolicyConfig(**d) for m, d in r["config"].items()}
    assert cfgs["dense"].num_experts == 0 and cfgs["dense"].intermediate_size == top_k * I
    assert cfgs["dense"].model_type == "qwen3" and cfgs["moe"].model_type == "qwen3_moe"
    pm, pd = r["params"]["moe"], r["params"]["dense"]
    assert pm["total"] == cfgs["moe"].num_params and pd["total"] == cfgs["dense"].num_params
    assert pm["active"] == pm["total"] - L * ((E - top_k) * 3 * h * I + h * E) == pd["total"] == pd["active"]
    assert pm["router"] == L * h * E and pm["expert_each"] == [3 * h * I] * L

    # the real parameters of each model, by part, for the floor's weight bytes
    policies = {m: Policy(c) for m, c in cfgs.items()}
    el = 4  # fp32 on CPU
    for m, policy in policies.items():
        base = sum(p.numel() for n, p in policy.named_parameters()
                   if not n.startswith("embed_tokens") and ".mlp.experts." not in n)  # untied: embedding gathered
        expert = {int(k): (l.mlp.experts.gate_up_proj.numel() + l.mlp.experts.down_proj.numel()) // E
                  for k, l in policy.layers.items() if m == "moe"}
        assert len(r["rows"]) == len(BATCHES)
        for row, B in zip(r["rows"], BATCHES):
            assert row["batch"] == B and set(row[m]["verify_over_step"]) == {str(k) for k in KS}
            for name in names:
                x = row[m][name]
                T = x["tokens_per_row"]
                assert T == (1 if name == "step" else int(name[len("verify_k"):]) + 1) and x["tokens"] == B * T
                assert {"t_ms", "t_ms_rounds", "t_over_floor", "floor_ms", "flops"} <= x.keys()
                touched = x.get("experts_touched_layers")
                want = base + (sum(c * expert[i] for i, c in enumerate(touched)) if m == "moe" else 0)
                assert x["weight_bytes"] == want * el, (m, name)
                cache = policy.new_cache(B, KV + T)
                assert x["kv_bytes"] == (cache.k.numel() + cache.v.numel()) * el
                bw = r["copy_bandwidth_TBps"] * 1e12
                assert x["floor_ms"] == pytest.approx((x["weight_bytes"] + x["kv_bytes"]) / bw * 1e3, rel=1e-9)
                if m == "dense":
                    assert touched is None
                    continue
                n = B * T
                assert len(touched) == L and all(top_k <= c <= min(E, n * top_k) for c in touched), (name, touched)
                assert x["experts_touched"] == pytest.approx(sum(touched) / L)
                assert x["experts_touched_uniform"] == pytest.approx(E * (1 - (1 - top_k / E) ** n))
                step = row[m]["step"]["experts_touched_layers"]
                assert all(v >= s for v, s in zip(touched, step)), (name, touched, step)
    assert r["dtype"] == "torch.float32" and r["graphs"] is False
