"""Export specco's EAGLE-3 draft for vLLM / SGLang, and import published EAGLE-3 drafts.

    export_draft(draft, out, "vllm")       -> out/config.json + out/model.safetensors (formats.py layout)
    import_draft(path, policy_cfg)         -> Eagle3Draft from an EAGLE / SpecForge / vLLM- or
                                              SGLang-export directory, checked against the policy
    load_draft(path, policy_cfg)           -> either a specco draft dir (draft_config.json) or the above

Tensors come from `draft.state_dict()`, whose keys are the EAGLE-3 names (q_proj / k_proj / v_proj /
gate_proj / up_proj even if the modules hold fused parameters internally), never from
`named_parameters()`. Writes are atomic: everything goes into a temporary sibling directory, is read
back and checked against the engine's expected names and config, and only then renamed into place,
so an engine never sees a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..model.config import ConfigError, DraftConfig, PolicyConfig, rope_config_from_hf
from ..model.draft import Eagle3Draft
from . import formats

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACCEPTED_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def export_draft(draft: Eagle3Draft, out: str | os.PathLike, engine: str,
                 policy_cfg: PolicyConfig | None = None, dtype: str | None = None,
                 overwrite: bool = False) -> Path:
    """Write `draft` in `engine`'s EAGLE-3 layout to `out`; returns `out`.

    policy_cfg: the target policy, when known: its hidden size / vocab / depth are checked against the
    draft's and max_position_embeddings becomes at least the policy's (engines clamp the draft's RoPE
    range to it). dtype: of the float weights (default: the draft's own); d2t stays int64, t2d bool.
    """
    eng, dc, out = formats.engine(engine), draft.cfg, Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose a new directory or pass overwrite=True (--force)")
    min_pos = dc.max_position_embeddings
    if policy_cfg is not None:
        _check_against_policy(dc, policy_cfg, f"draft for {engine} export")
        min_pos = max(min_pos, policy_cfg.max_position_embeddings)
    sd = draft.state_dict()
    extra = sorted(set(sd) - set(formats.tensor_shapes(dc)))
    if extra:  # e.g. a fused buffer whose state-dict hooks did not map it back to the HF names
        raise ValueError(f"draft state_dict has keys the EAGLE-3 layout does not define: {extra}")
    if dtype and dtype not in _DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: choose from {sorted(_DTYPES)}")
    fdtype = _DTYPES[dtype] if dtype else draft.fc.weight.dtype
    tensors = {k: (v.to(fdtype) if v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in sd.items()}
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    cfg = formats.engine_config(dc, eng, min_pos, str(fdtype).replace("torch.", ""))

    return write_checked(out, tensors, cfg, lambda c, shapes, dtypes: formats.check_export(
        c, shapes, dtypes, dc, eng, min_pos))


def write_checked(out: Path, tensors: dict, cfg: dict, check) -> Path:
    """config.json + model.safetensors into `out`, atomically: written into a temporary sibling directory,
    read back and passed to `check(config, shapes, dtypes)` (which raises on anything wrong), and only then
    renamed into place — an existing `out` (overwrite) is moved aside first, as a directory cannot be
    replaced. So an engine never sees a half-written or unchecked checkpoint."""
    from safetensors.torch import load_file, save_file
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        back = load_file(str(tmp / "model.safetensors"))  # check what is on disk, not what we meant to write
        check(json.loads((tmp / "config.json").read_text()), {k: tuple(v.shape) for k, v in back.items()},
              {k: str(v.dtype).replace("torch.", "") for k, v in back.items()})
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_against_policy(dc, pc: PolicyConfig, what: str, rope: bool = False):
    """A draft config (EAGLE-3's or a block drafter's) fits the policy: hidden size, vocabulary, aux layers in
    range; with `rope`, also the policy's RoPE (a DFlash draft rotates its keys as the target does)."""
    bad = []
    if dc.hidden_size != pc.hidden_size:
        bad.append(f"hidden_size {dc.hidden_size} != policy hidden_size {pc.hidden_size}")
    if dc.target_vocab_size != pc.vocab_size:
        bad.append(f"vocab_size {dc.target_vocab_size} != policy vocab_size {pc.vocab_size}")
    out_of_range = [i for i in dc.aux_layer_ids if not 0 <= i < pc.num_layers]
    if out_of_range:
        bad.append(f"aux layers {out_of_range} outside the policy's 0..{pc.num_layers - 1}")
    if rope and (dc.head_dim, dc.rope_theta, dc.rope_scaling) != (pc.head_dim, pc.rope_theta, pc.rope_scaling):
        bad.append(f"RoPE (head_dim {dc.head_dim}, theta {dc.rope_theta}, rope_scaling {dc.rope_scaling}) != the "
                   f"policy's ({pc.head_dim}, {pc.rope_theta}, {pc.rope_scaling}): the engines rotate the draft's "
                   "queries and keys as the target's")
    if bad:
        raise ConfigError(f"{what} does not fit the policy: {'; '.join(bad)}")


# -- import -----------------------------------------------------------------------------------

def _refuse(path: Path, field: str, value, supported: str):
    raise ConfigError(f"{path / 'config.json'}: {field}={value!r} is not supported: {supported}")


def aux_layer_ids_from_config(cfg: dict, num_layers: int | None, path: Path = Path(".")) -> tuple[int, ...]:
    """specco aux ids (output of layer i) of an EAGLE-3 config, in whichever convention it states them.

    `eagle_config.eagle_aux_hidden_state_layer_ids` is SGLang's (and SpecForge's): specco ids as they
    are. Top-level `eagle_aux_hidden_state_layer_ids` is vLLM's: entering-layer ids, minus 1. If both
    are present they must agree. If neither, both engines default to entering layers (2, L//2, L-3),
    which needs the policy's depth.
    """
    ec = cfg.get("eagle_config") or {}
    nested, top = ec.get("eagle_aux_hidden_state_layer_ids"), cfg.get("eagle_aux_hidden_state_layer_ids")
    from_sglang = tuple(int(i) for i in nested) if nested else None
    from_vllm = tuple(int(i) - 1 for i in top) if top else None
    if from_sglang and from_vllm and from_sglang != from_vllm:
        raise ConfigError(f"{path / 'config.json'}: eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} "
                          f"(SGLang: layer outputs) and eagle_aux_hidden_state_layer_ids={list(top)} (vLLM: layer "
                          "inputs, i.e. outputs + 1) name different layers; remove the wrong one")
    ids = from_sglang or from_vllm
    if ids is None:
        if num_layers is None:
            raise ConfigError(f"{path / 'config.json'} names no aux layers (eagle_aux_hidden_state_layer_ids); "
                              "the engines' default depends on the policy's depth: pass the policy config")
        ids = formats.engine_default_aux_ids(num_layers)
    return ids


def import_draft(path: str | os.PathLike, policy_cfg: PolicyConfig | None = None,
                 device="cpu", dtype=torch.float32) -> Eagle3Draft:
    """An Eagle3Draft from a published EAGLE-3 directory (config.json + model.safetensors or
    pytorch_model.bin): EAGLE (SafeAILab), SpecForge, or what `export_draft` writes for either engine.

    Refused by name: anything that would compute differently from specco's draft (more than one layer,
    non-SiLU, biases, norm_before_residual, fc_norm, tied head, RoPE scaling, a draft hidden size other
    than the target's) and any tensor that is missing, unknown or of the wrong shape. `embed_tokens.weight`
    (SpecForge saves the frozen target embedding) is dropped: specco's draft uses the policy's.
    """
    path = Path(path)
    f = path / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: not an EAGLE-3 draft directory")
    cfg = json.loads(f.read_text())
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ACCEPTED_ARCHITECTURES:
        _refuse(path, "architectures", cfg.get("architectures"), f"an EAGLE-3 Llama draft {ACCEPTED_ARCHITECTURES} "
                "(speculators-format 'Eagle3Speculator' configs are not read)")
    for field, ok in (("num_hidden_layers", 1), ("hidden_act", "silu"), ("attention_bias", False),
                      ("mlp_bias", False), ("bias", False), ("norm_before_residual", False),
                      ("fc_norm", False), ("tie_word_embeddings", False)):
        if cfg.get(field, ok) != ok:
            _refuse(path, field, cfg[field], f"specco's EAGLE-3 draft has {field}={ok!r}")
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True) is not True:
        _refuse(path, "eagle_config.use_aux_hidden_state", False, "EAGLE-3 drafts consume aux hidden states")
    h = cfg["hidden_size"]
    if cfg.get("target_hidden_size", h) != h:
        _refuse(path, "target_hidden_size", cfg["target_hidden_size"], f"the draft's hidden size ({h}): "
                "specco's draft concatenates the policy's embedding (target size) with its hidden state")
    V = cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    max_pos = cfg.get("max_position_embeddings", 4096)
    try:  # the policy reader's RoPE rules: refused types and keys are named
        theta, scaling = rope_config_from_hf(cfg, max_pos)
    except ConfigError as e:
        raise ConfigError(f"{path / 'config.json'}: {e}") from None
    dc = DraftConfig(
        hidden_size=h, intermediate_size=cfg["intermediate_size"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or h // heads,
        target_vocab_size=V, draft_vocab_size=cfg.get("draft_vocab_size") or V,
        aux_layer_ids=aux_layer_ids_from_config(cfg, policy_cfg.num_layers if policy_cfg else None, path),
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos)
    if len(dc.aux_layer_ids) != formats.NUM_AUX:
        _refuse(path, "eagle_aux_hidden_state_layer_ids", list(dc.aux_layer_ids), "exactly 3 aux layers")
    if policy_cfg is not None:
        _check_against_policy(dc, policy_cfg, f"draft {path}")
    sd = _read_tensors(path)
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    sd.pop("embed_tokens.weight", None)
    _vocab_maps(sd, dc, path)
    shapes = formats.tensor_shapes(dc)
    missing, extra = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))
    if missing or extra:
        raise ValueError(f"draft {path}: missing tensors {missing}, unexpected tensors {extra}")
    wrong = {k: (tuple(sd[k].shape), s) for k, s in shapes.items() if tuple(sd[k].shape) != s}
    if wrong:
        raise ValueError(f"draft {path}: tensors of the wrong shape (got, expected): {wrong}")
    model = Eagle3Draft(dc)
    model.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}, strict=True)
    return model.to(device=device, dtype=dtype)


def _read_tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if files:
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {path}")
    sd = {}
    for f in bins:
        sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return sd


def _vocab_maps(sd: dict, dc: DraftConfig, path: Path):
    """Complete and check d2t / t2d in place. SpecForge omits both when the draft vocab is the full
    target vocab (identity); t2d alone can be derived from d2t. Both must describe the same ids."""
    Vd, V = dc.draft_vocab_size, dc.target_vocab_size
    if "d2t" not in sd:
        if Vd != V:
            raise ValueError(f"draft {path}: no d2t although draft_vocab_size={Vd} < vocab_size={V}; "
                             "the draft ids' target ids are unknown")
        sd["d2t"] = torch.zeros(Vd, dtype=torch.long)
    sd["d2t"] = sd["d2t"].long()
    targets = torch.arange(Vd) + sd["d2t"]
    if targets.min() < 0 or targets.max() >= V or targets.unique().numel() != Vd:
        raise ValueError(f"draft {path}: d2t maps draft ids outside 0..{V - 1} or two onto one target id")
    mask = torch.zeros(V, dtype=torch.bool)
    mask[targets] = True
    if "t2d" in sd and not torch.equal(sd["t2d"].bool(), mask):
        raise ValueError(f"draft {path}: t2d does not mark exactly the target ids d2t maps to")
    sd["t2d"] = mask


def load_draft(path: str | os.PathLike, policy_cfg: PolicyConfig | None = None,
               device="cpu", dtype=torch.float32) -> Eagle3Draft:
    """A draft directory of any supported layout: specco's own (draft_config.json, `Eagle3Draft.save`)
    or an EAGLE-3 config.json layout (`import_draft`). Checked against the policy when given."""
    path = Path(path)
    if (path / "draft_config.json").exists():
        draft = Eagle3Draft.load(path, device=device, dtype=dtype)
        if policy_cfg is not None:
            _check_against_policy(draft.cfg, policy_cfg, f"draft {path}")
        return draft
    if (path / "config.json").exists():
        return import_draft(path, policy_cfg, device=device, dtype=dtype)
    raise FileNotFoundError(f"{path} is not a draft directory: no draft_config.json (specco) and no "
                            "config.json (EAGLE-3 layout)")
