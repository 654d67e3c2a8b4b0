"""Load and save Hugging Face checkpoints (config.json + model.safetensors) for the policy.

The policy's module names mirror transformers', so the mapping is a prefix: HF `model.X` <->
specco `X`, and `lm_head.weight` stays as it is. Tied heads are saved without `lm_head.weight`,
like transformers does. Loading is strict: any missing or unexpected tensor is an error.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import PolicyConfig
from .policy import Policy


def _to_hf_key(k: str) -> str:
    return k if k.startswith("lm_head.") else "model." + k


def _from_hf_key(k: str) -> str:
    return k[len("model."):] if k.startswith("model.") else k


def save_policy(model: Policy, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors into `path`, atomically per file (tmp + rename)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        sd[_to_hf_key(k)] = v.detach().cpu().clone()  # clone: fused-projection views share storage
    tmp = path / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    cfg = model.cfg.to_hf_dict()
    cfg["torch_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, path / "config.json")


def load_policy_config(path: str | os.PathLike) -> PolicyConfig:
    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: a policy directory needs config.json and "
                                "model.safetensors (a Hugging Face checkpoint)")
    return PolicyConfig.from_hf_dict(json.loads(f.read_text()))


def load_policy(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Policy:
    path = Path(path)
    cfg = load_policy_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd = {}
    for f in files:
        sd.update({_from_hf_key(k): v for k, v in load_file(str(f)).items()})
    # Rotary inverse-frequency buffers some exporters write are recomputed here, not loaded.
    sd = {k: v for k, v in sd.items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Policy(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the config: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model = model.to_empty(device=device)
    model.load_state_dict(sd, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype)
