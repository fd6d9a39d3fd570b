"""GatedDeltaNet (linear attention) layers of Qwen3.5/3.6 and Qwen3-Next: conv state + fp32 recurrent state.

The state is `[v_heads, k_dim, v_dim]` (kept in fp32, as transformers' torch fallback and fla's kernels compute it)
plus the conv's last `kernel - 1` inputs over `2 * key_dim + value_dim` channels: a few MiB per layer whatever the
prompt length. Capture, reads and out-of-place continuation are [`ConvRecurrentState`]'s.
"""

from __future__ import annotations

from .recurrent import FP32_BYTES, ConvRecurrentState, chunk_kernel_bytes
from .registry import LayerAccount, find_child

GATED_DELTANET_CHUNK = 64  # the chunk of transformers' torch_chunk_gated_delta_rule and of fla's chunked kernel


def is_gated_deltanet(module) -> bool:
    return all(hasattr(module, name) for name in ("A_log", "dt_bias", "conv1d", "head_k_dim", "head_v_dim"))


class LinearAttentionState(ConvRecurrentState):
    """Conv and recurrent state of one GatedDeltaNet layer."""

    name = "gated_deltanet"
    layer_types = ("linear_attention", "hybrid")
    sharded_layer_types = layer_types

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return find_child(layer, is_gated_deltanet)

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        recurrent = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim * FP32_BYTES
        conv = mixer.conv_dim * (mixer.conv_kernel_size - 1) * dtype_bytes
        return LayerAccount("gated_deltanet", fixed=recurrent + conv, per_chunk=exact)  # exact: one per chunk boundary

    @classmethod
    def replay_saved_bytes(cls, mixer):
        return chunk_kernel_bytes(mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, GATED_DELTANET_CHUNK)
