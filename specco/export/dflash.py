"""Export specco's DFlash drafter in the layout vLLM and SGLang serve, and import drafts of that layout.

    export_dflash(draft, out, policy_cfg)   -> out/config.json + out/model.safetensors (FORMATS.md, "DFlash")
    import_dflash(path, policy_cfg)         -> BlockDraft from such a directory (z-lab's published drafts too)
    load_block_draft(path, policy_cfg)      -> either a specco block-draft dir (draft_config.json) or the above

The layout is z-lab's `DFlashDraftModel` (a Qwen3 config with `block_size`, `num_target_layers` and
`dflash_config = {target_layer_ids, mask_token_id}`; no embedding and no LM head: the engines use the
target's). specco's DFlash computes what that model computes (model/dflash.py): the context features
`hidden_norm(fc(taps))` go through each layer's own k/v projections, k-norm and RoPE with no input norm;
a block `[x_n, mask, ...]` of `block_size` = γ + 1 slots attends to them and to itself without a causal
mask; the last norm's slots 1..γ score through the target's head. Its state-dict names are the layout's.
DSpark is refused: no engine serves its Markov and confidence heads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..model.config import ConfigError, PolicyConfig, hf_rope_fields, rope_config_from_hf
from ..model.dflash import BlockDraft, BlockDraftConfig
from .eagle3 import _DTYPES, _check_against_policy, _read_tensors, _refuse, export_draft, load_draft, write_checked

ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry: qwen3_dflash.DFlashQwen3ForCausalLM; SGLang's DFlashDraftModel


def tensor_shapes(dc: BlockDraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the layout and its shape (= a DFlash BlockDraft's state_dict)."""
    h, I, D = dc.hidden_size, dc.intermediate_size, dc.head_dim
    shapes = {"fc.weight": (h, len(dc.aux_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(dc.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (dc.num_heads * D, h),
                       p + "self_attn.k_proj.weight": (dc.num_kv_heads * D, h),
                       p + "self_attn.v_proj.weight": (dc.num_kv_heads * D, h),
                       p + "self_attn.o_proj.weight": (h, dc.num_heads * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "mlp.gate_proj.weight": (I, h), p + "mlp.up_proj.weight": (I, h),
                       p + "mlp.down_proj.weight": (h, I)})
    return shapes


def serving_config(dc: BlockDraftConfig, num_target_layers: int, max_position_embeddings: int, dtype: str) -> dict:
    """config.json. Every field the three readers (z-lab's model, vLLM's qwen3_dflash, SGLang's dflash) use to
    build the draft, set so they build specco's: full attention on every layer and no `causal` override (both
    engines then attend without a causal mask), no biases, SiLU, plain RoPE with the policy's theta."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": dc.hidden_size, "intermediate_size": dc.intermediate_size,
        "num_hidden_layers": dc.num_layers, "num_attention_heads": dc.num_heads,
        "num_key_value_heads": dc.num_kv_heads, "head_dim": dc.head_dim, "hidden_act": "silu",
        "rms_norm_eps": dc.rms_norm_eps, **hf_rope_fields(dc.rope_theta, dc.rope_scaling),
        "max_position_embeddings": max_position_embeddings, "vocab_size": dc.target_vocab_size,
        "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * dc.num_layers,
        "block_size": dc.block_size, "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(dc.aux_layer_ids), "mask_token_id": dc.mask_id},
        "torch_dtype": dtype,
    }


def check_serving(cfg: dict, shapes: dict, dtypes: dict, dc: BlockDraftConfig, num_target_layers: int,
                  max_pos: int) -> None:
    """What was written is what the readers need: the config above exactly, and exactly the tensors of
    `tensor_shapes` (SGLang skips names it does not know, so an extra or misnamed tensor would go unseen)."""
    want = serving_config(dc, num_target_layers, max_pos, cfg.get("torch_dtype"))
    bad = {k: (cfg.get(k), v) for k, v in want.items() if cfg.get(k) != v}
    if bad:
        raise ValueError(f"DFlash export config: wrong fields (written, expected): {bad}")
    expected = tensor_shapes(dc)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    wrong = {k: (shapes[k], s) for k, s in expected.items() if k in shapes and shapes[k] != s}
    if missing or extra or wrong:
        raise ValueError(f"DFlash export tensors: missing {missing}, unexpected {extra}, wrong shapes {wrong}")
    mixed = sorted({dtypes[k] for k in expected})
    if len(mixed) != 1 or mixed[0] != cfg["torch_dtype"]:
        raise ValueError(f"DFlash export: tensor dtypes {mixed} != torch_dtype {cfg['torch_dtype']!r}")


def export_dflash(draft: BlockDraft, out: str | os.PathLike, policy_cfg: PolicyConfig, dtype: str | None = None,
                  overwrite: bool = False) -> Path:
    """Write a DFlash `draft` for `policy_cfg`'s policy (its depth is `num_target_layers`; its
    max_position_embeddings, when larger, the draft's RoPE range) to `out`; atomic and checked."""
    dc, out = draft.cfg, Path(out)
    if dc.kind != "dflash":
        raise ConfigError(f"a {dc.kind} drafter cannot be exported: vLLM and SGLang serve DFlash drafts, and none "
                          "serves DSpark's Markov and confidence heads (export a draft.kind=dflash draft)")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose a new directory or pass overwrite=True (--force)")
    _check_against_policy(dc, policy_cfg, "DFlash draft for export", rope=True)
    if dtype and dtype not in _DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: choose from {sorted(_DTYPES)}")
    sd = draft.state_dict()
    if set(sd) != set(tensor_shapes(dc)):
        raise ValueError(f"draft state_dict keys differ from the DFlash layout: "
                         f"{sorted(set(sd) ^ set(tensor_shapes(dc)))}")
    fdtype = _DTYPES[dtype] if dtype else draft.fc.weight.dtype
    # clone: the fused projections' state-dict entries are views of one tensor, which safetensors refuses
    tensors = {k: v.detach().to(fdtype).cpu().clone().contiguous() for k, v in sd.items()}
    max_pos = policy_cfg.max_position_embeddings
    cfg = serving_config(dc, policy_cfg.num_layers, max_pos, str(fdtype).replace("torch.", ""))
    return write_checked(out, tensors, cfg, lambda c, shapes, dtypes: check_serving(
        c, shapes, dtypes, dc, policy_cfg.num_layers, max_pos))


def import_dflash(path: str | os.PathLike, policy_cfg: PolicyConfig | None = None, device="cpu",
                  dtype=torch.float32) -> BlockDraft:
    """A DFlash BlockDraft from a directory of the serving layout (what `export_dflash` writes; z-lab's drafts).

    Refused by name, as they would compute differently from specco's drafter: sliding-window or causal
    layers, biases, non-SiLU, RoPE scaling, a separate mask embedding (mask_embedding.pt), a reduced draft
    vocabulary, an own LM head or embedding, no target_layer_ids or mask_token_id."""
    path = Path(path)
    f = path / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: not a DFlash draft directory")
    cfg = json.loads(f.read_text())
    if (cfg.get("architectures") or [None])[0] != ARCHITECTURE:
        _refuse(path, "architectures", cfg.get("architectures"), f"a DFlash draft ({ARCHITECTURE!r})")
    dfc = cfg.get("dflash_config") or {}
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    for field, value, ok in (("layer_types", sorted(set(layer_types)), ["full_attention"]),
                             ("dflash_config.causal", dfc.get("causal", False), False),
                             ("dflash_config.use_swa", dfc.get("use_swa", False), False),
                             ("dflash_config.use_aux_hidden_state", dfc.get("use_aux_hidden_state", True), True),
                             ("attention_bias", cfg.get("attention_bias", False), False),
                             ("hidden_act", cfg.get("hidden_act", "silu"), "silu"),
                             ("draft_vocab_size", cfg.get("draft_vocab_size", cfg["vocab_size"]), cfg["vocab_size"]),
                             ("target_hidden_size", cfg.get("target_hidden_size", cfg["hidden_size"]), cfg["hidden_size"])):
        if value != ok:
            _refuse(path, field, value, f"specco's DFlash drafter has {field}={ok!r}")
    if (path / "mask_embedding.pt").exists():
        _refuse(path, "mask_embedding.pt", "present", "the mask slots use the target's embedding of mask_token_id")
    for key in ("target_layer_ids", "mask_token_id"):
        if dfc.get(key) is None:
            _refuse(path, f"dflash_config.{key}", None, "it must be given (specco does not guess a default)")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    try:  # the policy reader's RoPE rules: refused types and keys are named
        theta, scaling = rope_config_from_hf(cfg, cfg.get("max_position_embeddings") or 32768)
    except ConfigError as e:
        raise ConfigError(f"{path / 'config.json'}: {e}") from None
    dc = BlockDraftConfig(
        kind="dflash", hidden_size=h, intermediate_size=cfg["intermediate_size"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or h // heads,
        num_layers=cfg["num_hidden_layers"], target_vocab_size=cfg["vocab_size"], gamma=int(cfg["block_size"]) - 1,
        mask_id=int(dfc["mask_token_id"]), aux_layer_ids=tuple(int(i) for i in dfc["target_layer_ids"]),
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6))
    if policy_cfg is not None:
        _check_against_policy(dc, policy_cfg, f"DFlash draft {path}", rope=True)
        if cfg.get("num_target_layers", policy_cfg.num_layers) != policy_cfg.num_layers:
            _refuse(path, "num_target_layers", cfg["num_target_layers"], f"the policy's depth, {policy_cfg.num_layers}")
    sd = _read_tensors(path)
    shapes = tensor_shapes(dc)
    missing, extra = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))
    if missing or extra:
        raise ValueError(f"DFlash draft {path}: missing tensors {missing}, unexpected tensors {extra} (an own "
                         "lm_head or embed_tokens is not supported: specco's drafter uses the policy's)")
    wrong = {k: (tuple(sd[k].shape), s) for k, s in shapes.items() if tuple(sd[k].shape) != s}
    if wrong:
        raise ValueError(f"DFlash draft {path}: tensors of the wrong shape (got, expected): {wrong}")
    model = BlockDraft(dc)
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.to(device=device, dtype=dtype)


def load_block_draft(path: str | os.PathLike, policy_cfg: PolicyConfig | None = None, device="cpu",
                     dtype=torch.float32) -> BlockDraft:
    """A block drafter directory of either layout: specco's own (draft_config.json) or the serving one."""
    path = Path(path)
    if (path / "draft_config.json").exists():
        draft = BlockDraft.load(path, device=device, dtype=dtype)
        if policy_cfg is not None:
            _check_against_policy(draft.cfg, policy_cfg, f"block draft {path}", rope=True)
        return draft
    return import_dflash(path, policy_cfg, device=device, dtype=dtype)


def is_block_draft_dir(path: str | os.PathLike) -> bool:
    """A block drafter's directory: specco's (draft_config.json of a BlockDraft) or DFlash's serving layout."""
    path = Path(path)
    for name, key, want in (("draft_config.json", "architecture", BlockDraft.ARCHITECTURE),
                            ("config.json", "architectures", [ARCHITECTURE])):
        f = path / name
        if f.exists():
            got = json.loads(f.read_text()).get(key)
            return got == want or (isinstance(got, list) and got[:1] == want)
    return False


def load_any_draft(path: str | os.PathLike, policy_cfg: PolicyConfig | None = None, device="cpu",
                   dtype=torch.float32):
    """An EAGLE-3 draft (`load_draft`) or a block drafter (`dflash.load_block_draft`), whichever `path` holds."""
    if is_block_draft_dir(path):
        return load_block_draft(path, policy_cfg, device=device, dtype=dtype)
    return load_draft(path, policy_cfg, device=device, dtype=dtype)


def export_any_draft(draft, out: str | os.PathLike, engine: str, policy_cfg: PolicyConfig | None = None,
                     dtype: str | None = None, overwrite: bool = False) -> tuple[Path, str]:
    """Write `draft` in its kind's serving layout (the counterpart of `load_any_draft`): a block drafter in
    DFlash's (one layout for both engines, FORMATS.md "DFlash"; it needs `policy_cfg`, whose depth goes into
    its config), an EAGLE-3 draft in `engine`'s. Returns (out, one line saying what was written)."""
    if isinstance(draft, BlockDraft):
        if policy_cfg is None:
            raise ConfigError("a block drafter's export needs the target policy (specco export --policy): its depth "
                              "goes into the draft's config")
        path, dc = export_dflash(draft, out, policy_cfg, dtype=dtype, overwrite=overwrite), draft.cfg
        return path, (f"DFlash draft written to {path} for {engine} (block size {dc.block_size}, target layers "
                      f"{list(dc.aux_layer_ids)}, mask token {dc.mask_id})")
    path, dc = export_draft(draft, out, engine, policy_cfg, dtype=dtype, overwrite=overwrite), draft.cfg
    return path, (f"{engine} EAGLE-3 draft written to {path} (aux layers {list(dc.aux_layer_ids)}, "
                  f"draft vocab {dc.draft_vocab_size}/{dc.target_vocab_size})")
