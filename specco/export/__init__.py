"""Serving formats: EAGLE-3 drafts for vLLM and SGLang (export) and published EAGLE-3 drafts (import).

The layouts and each engine's conventions are written down in `formats.py` and FORMATS.md (with the
loader source files they were read from). DFlash export is not here yet: the block drafter it would
export has not landed.
"""
from .eagle3 import export_draft, import_draft, load_draft

__all__ = ["export_draft", "import_draft", "load_draft"]
