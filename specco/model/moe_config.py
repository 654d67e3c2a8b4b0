"""The Hugging Face config.json fields of the mixture-of-experts families (Qwen2-MoE, Qwen3-MoE): their defaults
as transformers 5 fills them, how they are read into PolicyConfig (model/config.py, the one reader of config.json,
calls here), and the values refused by name. The MoE layers themselves are model/moe.py."""
from __future__ import annotations


def _refused(field: str, value, supported: str):
    from .config import _refused  # here, not at the top: config.py imports this module
    return _refused(field, value, supported)


# transformers 5's defaults of the MoE fields a config.json may omit (Qwen2MoeConfig, Qwen3MoeConfig)
MOE_FAMILIES = {
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "router_aux_loss_coef": 0.001},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001},
}


def moe_fields_from_hf(d: dict, mt: str) -> dict:
    """PolicyConfig's MoE fields of config dict `d` of family `mt`, with transformers' defaults.
    Qwen3-MoE's own save_pretrained writes the expert count as `num_local_experts` (its attribute_map), the Hub
    checkpoints as `num_experts`: either is read, both present and different is refused."""
    fam = MOE_FAMILIES[mt]
    get = lambda k: fam[k] if d.get(k) is None else d[k]  # noqa: E731
    n = d.get("num_experts")
    if mt == "qwen3_moe" and d.get("num_local_experts") is not None:
        if n is not None and n != d["num_local_experts"]:
            raise _refused("num_local_experts", d["num_local_experts"], f"it differs from num_experts={n!r}; "
                           "transformers reads one as the other, remove one")
        n = d["num_local_experts"]
    out = {"num_experts": int(fam["num_experts"] if n is None else n),
           "num_experts_per_tok": int(get("num_experts_per_tok")),
           "moe_intermediate_size": int(get("moe_intermediate_size")),
           "norm_topk_prob": bool(get("norm_topk_prob")), "decoder_sparse_step": int(get("decoder_sparse_step")),
           "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
           "router_aux_loss_coef": float(get("router_aux_loss_coef"))}
    if mt == "qwen2_moe":  # Qwen2MoeSparseMoeBlock always builds its shared expert and its gate
        out["shared_expert_intermediate_size"] = int(get("shared_expert_intermediate_size"))
        if out["num_experts"] and out["shared_expert_intermediate_size"] < 1:
            raise _refused("shared_expert_intermediate_size", out["shared_expert_intermediate_size"],
                           "Qwen2-MoE's sparse layers always have a shared expert (>= 1)")
    bad = [i for i in out["mlp_only_layers"] if not 0 <= int(i) < d.get("num_hidden_layers", 0)]
    if bad:
        raise _refused("mlp_only_layers", list(out["mlp_only_layers"]), f"layer ids {bad} are out of range")
    return out


def refuse_moe_unsupported(d: dict) -> None:
    """Raise ConfigError on a MoE config field whose value specco does not compute (config._refuse_unsupported
    calls it for the MoE families, after the fields every family shares)."""
    # Qwen3-MoE windows every layer and Qwen2-MoE every other one below max_window_layers when
    # use_sliding_window is set (rules of their own, unlike config.qwen_layer_types'): refused as a whole
    if d.get("use_sliding_window", False):
        raise _refused("use_sliding_window", d["use_sliding_window"], "sliding-window attention is not "
                       "implemented in specco; only full attention (use_sliding_window=false)")
    other = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
    if other:
        raise _refused("layer_types", other, "only full_attention layers are implemented in specco")
