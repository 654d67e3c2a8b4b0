"""Reading a user's data files with Hugging Face `datasets`, and the checks that name what to fix.

The files of TRL (a `prompt` column: a string or chat messages), verl (parquet rows {data_source, prompt:
[messages], ability, reward_model: {style, ground_truth}, extra_info}) and NeMo-RL (JSONL with an input and
an output key) are read unchanged: JSON lines / JSON / Parquet / CSV through `datasets.load_dataset`, a
`save_to_disk` directory through `datasets.load_from_disk`. Nested columns arrive as dicts. No parser here is
hand-written; this file only turns `datasets`' failures and a file's surprises into messages that say which
key or row to change.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from specco.model.config import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# columns a prompt often lives in, suggested when data.prompt_key is missing and no name is close
PROMPT_LIKE = ("prompt", "messages", "question", "problem", "input", "query", "instruction", "text")


def read_table(path: str, key: str = "data.source"):
    """The rows of a data file or save_to_disk directory as a `datasets.Dataset` (memory-mapped Arrow)."""
    import datasets
    # datasets' own progress bars ("Generating train split") would interleave with specco's stage lines and land
    # in front of an error message; a file of prompts loads in well under a second
    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{key}={path!r}: no such file or directory (relative paths are from "
                                f"{os.getcwd()})")
    if p.is_dir():
        if (p / "dataset_dict.json").exists():  # a DatasetDict: its train split
            dd = datasets.load_from_disk(str(p))
            if "train" not in dd:
                raise ConfigError(f"{key}={path!r} is a DatasetDict with splits {list(dd)} and no 'train'; point "
                                  f"{key} at one split's directory ({p}/<split>)")
            return dd["train"]
        if (p / "state.json").exists() and (p / "dataset_info.json").exists():
            return datasets.load_from_disk(str(p))
        held = sorted(x.name for x in p.iterdir())
        shown = ", ".join(held[:10]) + (", ..." if len(held) > 10 else "") if held else "nothing"
        raise ConfigError(f"{key}={path!r} is a directory but not a datasets.save_to_disk directory (no state.json "
                          f"and dataset_info.json); it holds {shown}. Point {key} at one file "
                          f"({', '.join(BUILDERS)}) or at a directory written by Dataset.save_to_disk")
    builder = BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise ConfigError(f"{key}={path!r}: unknown file type {p.suffix!r}; data files are "
                          f"{', '.join(BUILDERS)} or a datasets.save_to_disk directory")
    try:
        return datasets.load_dataset(builder, data_files=str(p.resolve()), split="train")
    except Exception as e:  # datasets' own parse errors, re-raised naming the file
        if "corresponds to no data" in str(e):  # what datasets says of a file with no rows
            raise ConfigError(f"{key}={path!r} has no rows") from None
        raise ConfigError(f"{key}={path!r}: datasets could not read it as {builder}: "
                          f"{type(e).__name__}: {e}") from None


def dig(row: dict, key: str) -> Any:
    """row[key], through nested dicts for a dotted key ("reward_model.ground_truth"); None if absent."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def has_key(table, key: str) -> bool:
    """Whether `key` (maybe dotted) names a column of `table`, or a field nested in one."""
    head, _, rest = key.partition(".")
    if head not in table.column_names:
        return False
    if not rest:
        return True
    return len(table) > 0 and dig(table[0], key) is not None


def missing_column(table, key_name: str, key: str, where: str) -> ConfigError:
    """The error for a key naming no column: the columns there are and the closest one."""
    cols = list(table.column_names)
    close = difflib.get_close_matches(key.split(".")[0], cols, n=1, cutoff=0.5) or \
        [c for c in cols if c in PROMPT_LIKE][:1]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{key_name}={key!r} is not a column of {where}; its columns are {', '.join(cols)}{hint} "
                       f"(set {key_name})")


def resolve_key(table, key: str, auto: tuple[str, ...], key_name: str, where: str) -> str | None:
    """The column a key reads: `key` itself (which must exist), or with key "" the first of `auto` present
    (None if none is)."""
    if key:
        if not has_key(table, key):
            raise missing_column(table, key_name, key, where)
        return key
    return next((k for k in auto if has_key(table, k)), None)


def is_messages(value: Any) -> bool:
    """A list of {role, content} dicts, both strings (None-valued extra keys allowed: Arrow fills them)."""
    return isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)


def clean_messages(msgs: list[dict]) -> list[dict]:
    """Messages without the None fields Arrow adds when rows' message dicts have different keys."""
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]


def check_prompts(table, prompt_key: str, where: str) -> None:
    """Every row's prompt is a string or chat messages; else raise naming the first bad row and its type."""
    for i, value in enumerate(table[prompt_key]):
        if not (isinstance(value, str) or is_messages(value)):
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ConfigError(f"{where} row {i}: data.prompt_key={prompt_key!r} holds {type(value).__name__} "
                              f"{shown}; a prompt must be a string or chat messages [{{role, content}}, ...] "
                              "(fix the row, or point data.prompt_key at the prompt column)")


def as_text(value: Any) -> str | None:
    """A reference completion as text: a string as is, assistant messages' contents joined (TRL's
    conversational completions), a number as str; None for a missing value."""
    if value is None:
        return None
    if is_messages(value):
        return "".join(m["content"] for m in value if m["role"] == "assistant") or None
    if isinstance(value, (list, dict)):
        return None
    return str(value)
