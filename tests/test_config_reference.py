"""docs/config.md is what docs/gen_config_reference.py writes from the config dataclasses today, and the
generator finds sections (tables, nested tables, arrays of tables) and descriptions (comments above a field, a
trailing comment) without naming them."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_committed_reference_is_current(tmp_path):
    gen = _gen()
    out = tmp_path / "config.md"
    gen.main(["--out", str(out)])
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == committed, \
        "docs/config.md is stale: run python docs/gen_config_reference.py"


# A synthetic config tree: a nested table and an array of tables, as sections yet to come will be.
@dataclass(frozen=True)
class _Inner:
    """The inner table."""
    depth: int = 2  # how deep


@dataclass(frozen=True)
class _Item:
    # the item's name,
    # over two comment lines
    name: str = "x"

    weight: float = 1.0


@dataclass(frozen=True)
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    flag: bool = False


@dataclass(frozen=True)
class _Root:
    outer: _Outer = field(default_factory=_Outer)
    # reward functions, one table each
    items: tuple[_Item, ...] = ()
    out_dir: str = "runs/x"


def test_walk_finds_nested_tables_arrays_and_comments():
    gen = _gen()
    secs = {s.header: s for s in gen.walk(_Root)}
    assert list(secs) == ["top level", "[outer]", "[outer.inner]", "[[items]]"]
    top = {r.name: r for r in secs["top level"].rows}
    assert top["items"].default == "`[]`, array of tables `[[items]]`"
    assert top["items"].description == "reward functions, one table each"
    assert top["out_dir"].default == '`"runs/x"`' and top["out_dir"].description == ""
    assert secs["[[items]]"].intro == "reward functions, one table each"
    item = {r.name: r for r in secs["[[items]]"].rows}
    assert item["name"].description == "the item's name, over two comment lines"
    assert item["weight"].description == ""  # a blank line separates it from any comment above
    inner = secs["[outer.inner]"].rows[0]
    assert (inner.name, inner.type, inner.default, inner.description) == ("depth", "int", "`2`", "how deep")
    assert gen._class_doc(_Inner) == "The inner table."
    assert gen._class_doc(_Outer) == ""  # not the signature dataclasses put in __doc__
