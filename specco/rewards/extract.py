"""Reading the answer out of a completion: the one home for answer extraction.

Two readers, for two kinds of data:

* `final_answer(text)` -- the convention of math datasets and instruct models: the content of the last
  `\\boxed{...}` (nested braces balanced), else the text after the last `####` (GSM8K's references), else
  the content of the last `<answer>...</answer>` (reasoning_gym's and R1-style prompts). None when the
  text carries none of them. The `math` and `exact` rewards read completions *and* references with it,
  so a GSM8K `answer` column ("... #### 72") or a MATH `solution` column ("... \\boxed{72}") is a usable
  reference as it stands.
* `extract_answer(text, format)` -- specco's procedural reasoning_gym prompt formats (specco.data.procedural's
  formats): "chat" reads `<answer>` tags exactly as reasoning_gym's own evaluation does; "cot" / "rewrite"
  completions end `>answer` after their worked steps; "compact" completions are the bare answer.
"""
from __future__ import annotations

import re

FORMATS = ("chat", "compact", "cot", "rewrite", "lookup")

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces balance; `\\boxed 5` (the
    brace-less form LaTeX also accepts) gives '5'. Scanning from the last occurrence backwards means a
    truncated final box (`\\boxed{12` at the end of a cut-off completion) falls back to the one before it."""
    for m in reversed(list(_BOXED.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
            continue  # unbalanced: try an earlier box
        if i > m.end():  # `\boxed 5`: one token, ended by whitespace or '$'
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0)
    return None


def answer_tag(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` -- reasoning_gym's own reader, so that the
    reasoning_gym reward and reasoning_gym's published evaluations agree to the character."""
    from reasoning_gym.utils import extract_answer as rg_extract  # imported here: reasoning_gym loads ~1.5 s

    return rg_extract(text)


def final_answer(text: str) -> str | None:
    """`\\boxed{}` (last, balanced) > after the last `####` (its first line) > `<answer>` tags > None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    return answer_tag(text)


def extract_answer(text: str, format: str) -> str | None:
    """The answer in a completion written in one of specco's procedural prompt formats (FORMATS); None
    when the completion has no answer in that format (reasoning_gym's scorers give None 0 points)."""
    if format == "chat":
        return answer_tag(text)
    if format in ("cot", "rewrite", "lookup"):  # worked steps, then '>answer'; no '>' means no answer
        return text.rsplit(">", 1)[1].strip() if ">" in text else None
    if format == "compact":
        return text.strip()
    raise ValueError(f"answer format {format!r}: choose from {FORMATS}")
