"""Building a `RunConfig` (config.py) from dicts, TOML files and `key.sub=value` overrides, and back to a dict.

Callers import `load_config` and `config_to_dict` from here; specco.config does not import this module (it
imports specco.config lazily, so there is no import cycle).
"""
from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from pathlib import Path

from .model.config import ConfigError

if typing.TYPE_CHECKING:
    from .config import RunConfig


# -- building from dicts / TOML / overrides ------------------------------------------------

def _coerce(value, tp, path: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:  # `X | None`: None stays None (TOML has no null: omit the key)
        return None if value is None else _coerce(value, next(a for a in args if a is not type(None)), path)
    if tp is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{path}={value!r}: expected true/false")
        return bool(value)
    if tp in (int, float):
        try:
            v = tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}={value!r}: expected {tp.__name__}") from None
        if tp is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"{path}={value!r}: expected an integer")
        return v
    if tp is str:
        return str(value)
    if tp is dict or origin is dict:  # free-form options (a reasoning_gym dataset's own keyword arguments)
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a table of keys (in TOML `{path} = {{key = value}}`, on the command "
                              f"line {path}.key=value), got {value!r}")
        return {k: _literal(v) for k, v in value.items()}
    if origin is tuple:
        (inner, *_) = typing.get_args(tp)
        if dataclasses.is_dataclass(inner):  # an array of tables, [[reward]]
            items = [value] if isinstance(value, dict) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(x, dict) for x in items):
                raise ConfigError(f"{path} must be an array of tables (in TOML `[[{path}]]` sections), got {value!r}")
            return tuple(_build(inner, x, f"{path}[{i}].") for i, x in enumerate(items))
        if isinstance(value, str):  # "a,b", "[a, b]" or TOML's '["a", "b"]' from a command line
            value = [x.strip().strip("'\"") for x in value.strip("()[] ").split(",") if x.strip()]
        return tuple(_coerce(x.strip() if isinstance(x, str) else x, inner, path) for x in value)
    return value


def _literal(v):
    """A command-line value of a free-form table as TOML would read it (`3` -> 3, `true` -> True); other values
    (from a TOML file, already typed) as they are."""
    if not isinstance(v, str):
        return v
    try:
        return tomllib.loads(f"v = {v}")["v"]
    except tomllib.TOMLDecodeError:
        return v


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys: {names}"
            raise ConfigError(f"unknown config key {path!r}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} must be a table of keys, got {value!r}")
            kwargs[key] = _build(tp, value, path + ".")
        else:
            kwargs[key] = _coerce(value, tp, path)
    return cls(**kwargs)


def _set_dotted(d: dict, dotted: str, value):
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a table")
    d[parts[-1]] = value


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, tables merged key by key (a list or value replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_toml(p: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file's keys; a top-level `base = "other.toml"` (relative to this file) is read first and this
    file's keys override it, table by table: a config per arm set without copying the workload's keys."""
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist (see configs/ for examples)")
    if p.resolve() in seen:
        raise ConfigError(f"{p}: `base` chain loops back to it ({' -> '.join(map(str, seen + (p,)))})")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{p}: base={base!r} must be a path string (relative to {p.parent})")
    return _merge(_read_toml(p.parent / base, seen + (p.resolve(),)), data)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                tables: dict | None = None) -> RunConfig:
    """RunConfig from an optional TOML file, then `tables` (keys as a TOML file would hold them, e.g. the CLI's
    `{"reward": [{"name": "math"}]}`, replacing the file's), then `key.sub=value` overrides (applied in order)."""
    data = _read_toml(Path(path)) if path is not None else {}
    data = _merge(data, tables or {})
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like key.sub=value (e.g. train.steps=10)")
        key, value = ov.split("=", 1)
        _set_dotted(data, key.strip(), value.strip())
    from .config import RunConfig  # lazily: config.py is the schema, this module only reads into it
    return _build(RunConfig, data, "")


def config_to_dict(cfg) -> dict:
    d = dataclasses.asdict(cfg)

    def fix(x):
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return list(x)
        return x
    return fix(d)
