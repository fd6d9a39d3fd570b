"""trl-longstraw: long-context GRPO by capturing each group's prompt once and replaying completions serially."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import LongStrawGRPOConfig
    from .trainer import LongStrawGRPOTrainer

__all__ = ["LongStrawGRPOConfig", "LongStrawGRPOTrainer"]
__version__ = "0.1.0"

# Imported on first use (PEP 562), as transformers' lazy modules: `trl-longstraw --help` and `--version` do not pay
# for torch, transformers and TRL.
_LAZY = {"LongStrawGRPOConfig": ".config", "LongStrawGRPOTrainer": ".trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
