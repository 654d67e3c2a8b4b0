"""Serving formats: EAGLE-3 and DFlash drafts for vLLM and SGLang (export) and published drafts (import).

The layouts and each engine's conventions are written down in `formats.py`, `dflash.py` and FORMATS.md (with
the loader source files they were read from).
"""
from .dflash import export_any_draft, export_dflash, import_dflash, load_any_draft, load_block_draft
from .eagle3 import export_draft, import_draft, load_draft

__all__ = ["export_draft", "import_draft", "load_draft", "export_dflash", "import_dflash", "load_block_draft",
           "load_any_draft", "export_any_draft"]
