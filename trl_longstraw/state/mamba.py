"""Mamba2 (SSD) layers of the Mamba2 hybrids (Nemotron-H, Granite 4 hybrid, Falcon-H1): conv state + SSM state.

The SSM state is `[heads, head_dim, ssm_state_size]` (fp32) and the conv keeps the last `kernel - 1` inputs over
`intermediate + 2 * groups * ssm_state_size` channels: like GatedDeltaNet, its size does not depend on the prompt
length. transformers' Mamba2 mixers reach their state through the same Cache API as GatedDeltaNet
(`get/update_conv_state`, `get/update_recurrent_state`, with `initial_states` fed to the chunked scan), so capture,
reads and the out-of-place continuation are [`ConvRecurrentState`]'s: this kind only recognises the mixer and
accounts for it.
"""

from __future__ import annotations

from .recurrent import FP32_BYTES, ConvRecurrentState, chunk_kernel_bytes
from .registry import LayerAccount, find_child


def is_mamba2(module) -> bool:
    return all(hasattr(module, name) for name in ("A_log", "D", "conv1d", "ssm_state_size", "num_heads", "head_dim"))


class Mamba2State(ConvRecurrentState):
    """Conv and SSM state of one Mamba2 mixer."""

    name = "mamba2"
    layer_types = ("linear_attention", "hybrid", None)
    sharded_layer_types = layer_types

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return find_child(layer, is_mamba2)

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        ssm = mixer.num_heads * mixer.head_dim * mixer.ssm_state_size * FP32_BYTES
        conv = mixer.conv_dim * (mixer.conv_kernel_size - 1) * dtype_bytes
        return LayerAccount("mamba2", fixed=ssm + conv, per_chunk=exact)  # exact: one per chunk boundary

    @classmethod
    def replay_saved_bytes(cls, mixer, dtype_bytes, fused):
        """The torch fallback's fp32 chunk matrices, fused or not: mamba-ssm's kernels keep less (an upper bound for
        them, not measured)."""
        return chunk_kernel_bytes(mixer.num_heads, mixer.ssm_state_size, mixer.head_dim, mixer.chunk_size)
