"""Rewards the user chooses (`[[reward]]` in the job config): built-ins and the user's TRL / verl functions,
batched per step. specco.rewards.core has the rules; builtins, user and extract the pieces.

The names below load on first use (PEP 562): the math reward's spawned workers import
specco.rewards.math_worker, and through it this package, and must not pay for torch.
"""
import importlib

_EXPORTS = {
    "Rewards": "core", "RewardSpec": "core", "RewardBatch": "core", "RewardError": "core", "BUILTINS": "core",
    "extract_answer": "extract", "final_answer": "extract", "last_boxed": "extract", "FORMATS": "extract",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"specco.rewards.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specco.rewards' has no attribute {name!r}")
