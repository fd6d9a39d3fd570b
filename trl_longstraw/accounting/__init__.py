"""Memory accounting, in two parts: the prompt state's bytes, asked of each state kind (`prompt_state.py`), and the
whole update on one device, predicted from a config (`update.py`)."""

from .prompt_state import (
    LayerTypeAccount,
    StateAccount,
    prompt_state_account,
    prompt_state_bytes,
    stock_activation_bytes,
    under_context_parallelism,
)
from .update import (
    GraphAccount,
    LoraAccount,
    UpdateAccount,
    UpdateSetup,
    WeightAccount,
    capture_chunk_account,
    lora_account,
    nf4_weight_bytes,
    replay_graph_account,
    replay_in_steps_account,
    step_attention_bytes,
    update_account,
    weight_account,
)

__all__ = [
    "GraphAccount",
    "LayerTypeAccount",
    "LoraAccount",
    "StateAccount",
    "UpdateAccount",
    "UpdateSetup",
    "WeightAccount",
    "capture_chunk_account",
    "lora_account",
    "nf4_weight_bytes",
    "prompt_state_account",
    "prompt_state_bytes",
    "replay_graph_account",
    "replay_in_steps_account",
    "step_attention_bytes",
    "stock_activation_bytes",
    "under_context_parallelism",
    "update_account",
    "weight_account",
]
