"""Load and save Hugging Face checkpoints (config.json + model.safetensors, or shards named by
model.safetensors.index.json) for the policy, and check them at the boundary (`check_policy_dir`,
`check_tokenizer_fits`): every bad input raises FileNotFoundError or ConfigError naming the file and
the fix, never a bare traceback from inside safetensors or torch.

The policy's module names mirror transformers', so the mapping is a prefix: HF `model.X` <->
specco `X`, and `lm_head.weight` stays as it is. Tied heads are saved without `lm_head.weight`,
like transformers does. Loading is strict: any missing or unexpected tensor is an error. MoE experts are
written one tensor per expert and projection (`experts.{e}.gate_proj.weight`, the Hub's and transformers'
`save_pretrained` layout) and read in that layout or transformers 5's fused 3-D one (model/moe.py says why).

Two ways in:

    policy = load_policy(dir)                      # the whole policy, every tensor read whole
    load_policy_rows(dir, model, rows_of)          # fill a materialised model row range by row range

`load_policy_rows` is the sharded load (docs: README "GPUs and torchrun"): the caller builds the policy on
the meta device, shards it from outside (parallel/load.py: `apply_fsdp`, then `to_empty`), and passes
`rows_of(param) -> (local tensor, first row, end row)`, the rows of dim 0 this process holds
(parallel.fsdp.shard_rows); only those rows' bytes are read from the files (safetensors' `get_slice`). A
fused parameter (`qkv_proj`, `gate_up_proj`: layers.fuse_linears) is the concatenation of several HF tensors
along dim 0, so its row range is read piecewise from each part it overlaps (`policy_layout`).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import ConfigError, PolicyConfig
from .moe import split_fused_experts
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
    """The PolicyConfig of checkpoint directory `path` (`check_policy_dir`: the files are checked too)."""
    return check_policy_dir(path)


def _read_json(f: Path, what: str) -> dict:
    """json.loads of `f`, a ConfigError naming the file, line and column when it is not JSON."""
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                          f"{what}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); {what}") from None


def _safetensors_header(f: Path) -> dict:
    """The JSON header of safetensors file `f`, after checking the file holds every byte it promises.

    Layout: 8 bytes little-endian header length n, n bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": ...}, then the data, offsets relative to its start.
    Checked here so a truncated download fails with the file's name, not inside the loader."""
    size = f.stat().st_size
    fix = "re-download or re-save it (the file is truncated or corrupt)"
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ConfigError(f"{f}: {size} bytes, too short for a safetensors header; {fix}")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise ConfigError(f"{f}: header length {n} exceeds the file's {size} bytes; {fix}")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"{f}: the safetensors header is not readable JSON; {fix}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{f}: the safetensors header is not a JSON object; {fix}")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConfigError(f"{f}: the header says the data is {end} bytes but the file holds {size - 8 - n}; {fix}")
    return header


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a policy directory: the shards `model.safetensors.index.json` names
    (transformers' sharded layout, how 1B+ checkpoints come), else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, "re-download it or re-save the checkpoint").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index} has no 'weight_map'; re-download it or re-save the checkpoint")
        files = [path / s for s in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards missing from {path}: {missing[:5]}; "
                                    "download every shard of the checkpoint")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        instead = f" (it has {other[:5]})" if other else ""
        raise FileNotFoundError(
            f"no *.safetensors in {path}{instead}: specco loads safetensors only (pickled .bin files can "
            "run code when loaded); convert with transformers: AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(out_dir, safe_serialization=True)")
    return files


def check_policy_dir(path: str | os.PathLike) -> PolicyConfig:
    """The PolicyConfig of HF checkpoint directory `path`, after checking what can be checked without
    reading the weights: the directory, config.json (present, JSON, a supported config), and the
    safetensors files (single or sharded via model.safetensors.index.json) with complete headers.
    Raises FileNotFoundError or ConfigError whose message names the file and the fix; `load_policy`
    goes through it, and commands call it before doing any work."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"policy directory {path} does not exist (or is not a directory); pass a "
                                "Hugging Face checkpoint directory holding config.json and *.safetensors")
    f = path / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: a policy directory needs config.json and "
                                "model.safetensors (a Hugging Face checkpoint)")
    d = _read_json(f, "fix the file or re-download the checkpoint")
    try:
        cfg = PolicyConfig.from_hf_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from None
    for w in _weight_files(path):
        _safetensors_header(w)
    return cfg


def check_tokenizer_fits(policy_dir: str | os.PathLike) -> int:
    """Raise ConfigError unless every id of `policy_dir`/tokenizer.json (added tokens included) is below
    config.json's vocab_size: an id past the embedding table would index out of range on the first
    forward. Returns the number of ids the tokenizer uses (max id + 1). Commands call this before
    doing any work."""
    path = Path(policy_dir)
    cfg = check_policy_dir(path)
    f = path / "tokenizer.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: a policy directory needs tokenizer.json next to config.json "
                                "(save the model's tokenizer there)")
    d = _read_json(f, "re-save the tokenizer (tokenizer.save_pretrained(dir))")
    vocab = (d.get("model") or {}).get("vocab") or {}
    # WordLevel/BPE/WordPiece keep {token: id}; Unigram keeps [[token, score], ...] with ids = positions.
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1] if vocab else []
    ids += [t["id"] for t in d.get("added_tokens") or []]
    used = max(ids) + 1 if ids else 0
    if used > cfg.vocab_size:
        raise ConfigError(f"{f} uses token ids up to {used - 1} ({used} ids, added tokens included) but "
                          f"{path / 'config.json'} has vocab_size={cfg.vocab_size}: the tokenizer is not this "
                          "model's; use the tokenizer saved with the model, or resize the embeddings and "
                          "save the model again")
    return used


def _load_checked(f: Path) -> dict[str, torch.Tensor]:
    """load_file(f), its errors re-raised naming the file, refusing NaN or inf weights by tensor name."""
    try:
        sd = load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"{f} could not be read as safetensors ({e}); re-download or re-save it") from None
    for k, v in sd.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise ConfigError(f"{f}: tensor {k!r} holds {bad} NaN/inf values; the checkpoint is corrupt "
                              "(re-download it) or was saved from a diverged run (use an earlier checkpoint)")
    return sd


def load_policy(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Policy:
    """The policy in HF checkpoint directory `path` (single or sharded safetensors), checked by
    `check_policy_dir` first; unreadable files and NaN/inf weights raise ConfigError naming them."""
    path = Path(path)
    cfg = check_policy_dir(path)
    sd = {}
    for f in _weight_files(path):
        sd.update({_from_hf_key(k): v for k, v in _load_checked(f).items()})
    sd = split_fused_experts(sd)  # fused 3-D expert tensors -> the per-expert names the model reports
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
        raise ConfigError(f"checkpoint {path} does not match the config: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model = model.to_empty(device=device)
    model.load_state_dict(sd, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype)


def policy_layout(model: Policy) -> dict[str, list[tuple[str, int]]]:
    """{parameter name: [(HF key, rows), ...]} for every parameter of `model` (`named_parameters` order: a tied
    head once, as the embedding it is): the HF tensors whose concatenation along dim 0 the parameter is. One for
    most; q, k, v for `qkv_proj` and gate, up for `gate_up_proj` (the parts `layers.fuse_linears` recorded on
    the module). Shapes are the whole tensors' (a DTensor's `shape` is global), so a sharded model has the
    layout of the whole one."""
    fused = {}
    for mod_name, mod in model.named_modules():
        pre = f"{mod_name}." if mod_name else ""
        for name, parts in getattr(mod, "fused_linears", {}).items():
            for suffix in ("weight", "bias"):
                fused[f"{pre}{name}.{suffix}"] = [(_to_hf_key(f"{pre}{part}.{suffix}"), n) for part, n in parts]
    return {k: fused.get(k, [(_to_hf_key(k), p.shape[0])]) for k, p in model.named_parameters()}


class HFTensors:
    """The tensors of a HF checkpoint directory by name, read a row range at a time: `safe_open(...).get_slice`
    maps the file and copies out only the requested rows' bytes, so a rank that holds 1/n of a tensor reads
    1/n of it. Headers are read once here (`check_policy_dir` checked them)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.cfg = check_policy_dir(self.path)
        self.where: dict[str, tuple[Path, tuple[int, ...]]] = {}  # HF key -> (its file, its shape)
        for f in _weight_files(self.path):
            for k, v in _safetensors_header(f).items():
                if k != "__metadata__":
                    self.where[k] = (f, tuple(v["shape"]))

    def check(self, layout: dict[str, list[tuple[str, int]]], shapes: dict[str, tuple[int, ...]]) -> None:
        """Every HF tensor `layout` names is in the files with the shape the model needs (`shapes`: the model's
        parameter shapes by name), and the files hold nothing else but what loading ignores (rotary buffers, a
        tied head). A ConfigError names the key, the file and the fix otherwise."""
        expected = {}
        for name, parts in layout.items():
            for key, n in parts:
                expected[key] = (n, *shapes[name][1:]) if len(parts) > 1 else tuple(shapes[name])
        for key, shape in expected.items():
            if key not in self.where:
                raise ConfigError(f"checkpoint {self.path}: tensor {key!r} is missing from "
                                  f"{', '.join(sorted({f.name for f, _ in self.where.values()})) or 'its files'}; "
                                  f"the checkpoint does not match its config.json (re-download or re-save it)")
            f, found = self.where[key]
            if found != shape:
                raise ConfigError(f"{f}: tensor {key!r} has shape {list(found)}, config.json's model needs "
                                  f"{list(shape)}; the checkpoint does not match its config.json (re-save it)")
        ignored = "lm_head.weight" if self.cfg.tie_word_embeddings else None
        extra = sorted(k for k in self.where if k not in expected and k != ignored and "rotary_emb" not in k)
        if extra:
            raise ConfigError(f"checkpoint {self.path} does not match the config: unexpected {extra[:5]} "
                              f"in {self.where[extra[0]][0].name}")

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of tensor `key`, refused (ConfigError naming file and key) if not finite.
        The file is opened for this read only: the pages a read maps count in the process's resident memory
        while the file stays open, so a handle kept across a whole load would hold this rank's share of the
        checkpoint's bytes on top of its shards (bench/sharded_load.py measured ~1x the shards more)."""
        f, _ = self.where[key]
        try:
            with safe_open(str(f), framework="pt") as fh:
                t = fh.get_slice(key)[start:stop]
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f} could not be read as safetensors ({e}); re-download or re-save it") from None
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{f}: tensor {key!r} holds {int((~torch.isfinite(t)).sum())} NaN/inf values in rows "
                              f"[{start}, {stop}); the checkpoint is corrupt (re-download it) or was saved from a "
                              "diverged run (use an earlier checkpoint)")
        return t

    def read_rows_into(self, out: torch.Tensor, parts: list[tuple[str, int]], start: int) -> None:
        """Fill `out` with rows [start, start + len(out)) of the concatenation of `parts` along dim 0
        (`policy_layout`), read piecewise and cast to out's dtype: part i covers rows [off_i, off_i + n_i) of the
        whole. One part's rows in flight at a time, never the concatenation."""
        stop, off = start + out.shape[0], 0
        for key, n in parts:
            a, b = max(start, off), min(stop, off + n)
            if a < b:
                out[a - start:b - start].copy_(self.rows(key, a - off, b - off).to(out.dtype))
            off += n


def whole_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """`rows_of` of an unsharded model: every row of the parameter."""
    return param, 0, param.shape[0]


@torch.no_grad()
def load_policy_rows(path: str | os.PathLike, model: Policy, rows_of=whole_rows) -> Policy:
    """Fill `model` — its storage allocated (`to_empty` after building it on the meta device) — from the HF
    checkpoint at `path`, reading for each parameter only the rows `rows_of(param)` names: (the local tensor to
    write, first row, end row) of dim 0 of the whole parameter (parallel.fsdp.shard_rows under FSDP;
    `whole_rows`, the default, reads everything). Checked first (`HFTensors.check`): a missing tensor or a wrong
    shape is a ConfigError naming the key and the file; `model`'s config must be the directory's. Values are
    cast to the model's dtype, as `load_policy(...).to(dtype)` casts them: the same bits. A tied head shares the
    embedding's storage, so it is filled with it; re-tie after `to_empty` (which unties) before calling."""
    src = HFTensors(path)
    if src.cfg.moe:
        raise ConfigError(f"{path}: the row-wise sharded load of a mixture-of-experts policy ({src.cfg.model_type}) "
                          "is not implemented (its per-expert tensors are stacked into (E, ...) parameters); load it "
                          "whole (hf_io.load_policy) and shard it with parallel.load.sharded_copy, as `specco train` "
                          "does")
    if src.cfg != model.cfg:
        raise ConfigError(f"{Path(path) / 'config.json'} describes another model than the one being filled "
                          f"({src.cfg} vs {model.cfg}); build the model from load_policy_config({path})")
    layout = policy_layout(model)
    params = dict(model.named_parameters())
    src.check(layout, {k: tuple(p.shape) for k, p in params.items()})
    for name, parts in layout.items():
        local, start, stop = rows_of(params[name])
        assert local.shape[0] == stop - start, (name, tuple(local.shape), start, stop)
        src.read_rows_into(local, parts, start)  # the cast load_policy's .to(dtype) makes, row for row
    return model
