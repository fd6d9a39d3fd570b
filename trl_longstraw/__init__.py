"""trl-longstraw: long-context GRPO by capturing each group's prompt once and replaying completions serially."""

from .config import LongStrawGRPOConfig
from .trainer import LongStrawGRPOTrainer

__all__ = ["LongStrawGRPOConfig", "LongStrawGRPOTrainer"]
__version__ = "0.1.0"
