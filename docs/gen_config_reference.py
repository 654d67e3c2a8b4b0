"""Write docs/config.md, the reference of every run-config key, from the config dataclasses themselves.

    python docs/gen_config_reference.py            # rewrites docs/config.md
    python docs/gen_config_reference.py --out F    # writes F instead (tests/test_config_reference.py)

Nothing here names a section: the sections are found by walking `RunConfig`'s dataclass fields recursively.
A field typed as a dataclass is a TOML table (`[train]`, `[a.b]` when nested); a field typed
`tuple[SomeSpec, ...]` with a dataclass `SomeSpec` is an array of tables (`[[name]]`); any other field is a key
of the table it sits in. So a section added to the config tree appears here on the next run, unedited.

Where each row's words come from (the config's source is the one place they are written):
* key, type: the field's name and its annotation as written in the source (`ast.unparse`);
* default: the dataclass default (or `default_factory()`), printed as TOML would spell it;
* description: the comment lines directly above the field (a contiguous run of `# ...` lines, no blank line
  between them and the field) followed by the trailing `# ...` comment on the field's own line(s), read with
  `inspect.getsource` + `tokenize` (comments) and `ast` (where each field starts and ends);
* each section's text: the class docstring (from the AST, not `__doc__`: dataclasses invent one), then the
  comment above the field that holds the section in its parent.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the checkout's specco
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "docs" / "config.md"


@dataclasses.dataclass
class FieldDoc:
    name: str
    type: str  # the annotation as written
    default: str  # markdown: the TOML spelling in backticks, or where the section's table is
    description: str


def _class_source(cls) -> tuple[ast.ClassDef, dict[int, str], set[int]]:
    """(the class's AST node, {line: comment text} of its source, lines holding only a comment), lines 1-based
    within the dedented class source."""
    src = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.ClassDef), cls
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            for line in range(tok.start[0], tok.end[0] + 1):
                code_lines.add(line)
    comment_only = {line for line in comments if line not in code_lines}
    return node, comments, comment_only


def _field_comments(cls) -> dict[str, tuple[str, str]]:
    """{field name: (annotation as written, description)} from the comments around each field."""
    node, comments, comment_only = _class_source(cls)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line in comment_only:  # the contiguous comment block directly above (stops at a blank line)
            above.append(comments[line])
            line -= 1
        trailing = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1)
                    if n in comments and n not in comment_only]
        words = " ".join(list(reversed(above)) + trailing)
        out[stmt.target.id] = (ast.unparse(stmt.annotation), words)
    return out


def _class_doc(cls) -> str:
    node, _, _ = _class_source(cls)
    doc = ast.get_docstring(node)
    return " ".join(doc.split()) if doc else ""


def _toml(value) -> str:
    """A default as it would be written in a TOML config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "(table)"
    return repr(value)


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _element_dataclass(hint) -> type | None:
    """SomeSpec when `hint` is tuple[SomeSpec, ...] (or list[SomeSpec]) of a dataclass, else None."""
    if typing.get_origin(hint) in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


@dataclasses.dataclass
class Section:
    header: str  # "[train]", "[[rewards]]", or "top level"
    cls: type
    intro: str  # the comment on the field holding this section in its parent
    rows: list[FieldDoc]


def walk(cls, path: str = "", intro: str = "", array: bool = False) -> list[Section]:
    """The sections of config class `cls` at dotted `path` ('' = the root), depth first in field order."""
    hints = typing.get_type_hints(cls)
    words = _field_comments(cls)
    rows, children = [], []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        annotation, description = words.get(f.name, (str(hint), ""))
        sub = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hint):
            children.append((hint, sub, description, False))
            rows.append(FieldDoc(f.name, annotation, f"table `[{sub}]`", description))
        elif (elem := _element_dataclass(hint)) is not None:
            children.append((elem, sub, description, True))
            default = _default(f)
            shown = "[]" if default in ((), []) else _toml(default)
            rows.append(FieldDoc(f.name, annotation, f"`{shown}`, array of tables `[[{sub}]]`", description))
        else:
            default = _default(f)
            rows.append(FieldDoc(f.name, annotation,
                                 "(required)" if default is dataclasses.MISSING else f"`{_toml(default)}`",
                                 description))
    header = "top level" if not path else (f"[[{path}]]" if array else f"[{path}]")
    out = [Section(header, cls, intro, rows)]
    for child, sub, words_, is_array in children:
        out += walk(child, sub, words_, is_array)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from specco.config import RunConfig

    lines = [
        "# Run-config reference",
        "",
        "<!-- Generated by `python docs/gen_config_reference.py` from the config dataclasses "
        "(`specco.config.RunConfig` and the sections it holds); do not edit by hand. "
        "tests/test_config_reference.py fails when this file is stale. -->",
        "",
        "One TOML file, one typed tree (`specco/config.py`). Every key below can also be set on the command line "
        "as a dotted path (`specco train CONFIG train.steps=20 parallel.cp=2`). Unknown keys are errors.",
        "",
    ]
    for sec in walk(RunConfig):
        where = f"`{sec.cls.__module__}.{sec.cls.__qualname__}`"
        lines += [f"## {sec.header if sec.header == 'top level' else '`' + sec.header + '`'}", "", where, ""]
        for text in (_class_doc(sec.cls), sec.intro):
            if text:
                lines += [text, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for r in sec.rows:
            lines.append(f"| `{r.name}` | `{_cell(r.type)}` | {_cell(r.default)} | {_cell(r.description)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write (default docs/config.md)")
    a = ap.parse_args(argv)
    a.out.write_text(render(), encoding="utf-8")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
