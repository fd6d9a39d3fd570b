"""Stand-ins for the kernels a simulation cannot run on fake tensors: custom ops whose fake implementations allocate
what the real kernels allocate, with their FLOPs and workspace registered for the tracker.

A GPU runs two Triton kernels in the update that a simulation cannot (Triton needs a driver, and fake tensors have no
data): flash-linear-attention's GatedDeltaNet rule, which transformers' Qwen3.5/3.6 and Qwen3-Next layers call through
their kernel functions (`mixer._kernel_funcs`, the hook `kernels.kernelize` replaces the same way), and the tile folds
of TRL's fused LM head (`trl.kernels.chunked_logprob`), which run wherever Triton is installed and score only the
label mask's positions (the `compact` path). Each stand-in is listed in the report's `stand_ins` and in
docs/simulation.md with the derivation of its bytes.

GatedDeltaNet, chunked (fla 0.6.0 `chunk_gated_delta_rule`, as transformers calls it: q/k L2-normalised in the
kernel, `[B, T, H, D]` layout, 64-token chunks). With `T_p` the tokens padded to a chunk, `NT = T_p / 64`, `Hk` q/k
heads, `H` value heads, `K`, `V` head widths, "in" the inputs' dtype:

- forward, kept for backward: L2-normalised q and k (`[B, T, Hk, K]` in) and their reciprocal norms (`[B, T, Hk]`
  fp32), the chunk-local cumulative gate (`[B, T, H]` fp32), the inverted within-chunk system `A` (`[B, T, H, 64]`
  in), and v, copied when it is not contiguous (`input_guard`; transformers passes views of the conv output); returned:
  `o` (`[B, T, H, V]` in) and the final state (`[B, H, K, V]` fp32); workspace while `chunk_fwd_o` runs: `w`, `u`,
  `v_new` (`[B, T, H, K|V]` in) and the chunk states `h` (`[B, NT, H, K, V]` in), and the contiguous copies of q and
  k, freed when the forward returns;
- backward: returned `dq`, `dk` (`[B, T, Hk, K]` in), `dv` (in), `dbeta` (`[B, T, H]` in), `dg` (fp32) and, with a
  starting state, its gradient (fp32); workspace at its peak (`chunk_bwd_dqkwg`): `w`, `u`, `v_new`, `dv`, `dw`, the
  per-value-head `dq`/`dk` (`[B, T, H, K]` in), `h` and `dh` (`[B, NT, H, K, V]` in), and `dg`'s partial sums
  (`[ceil(K / 128), B, T, H]` fp32, Hopper's tiling);
- FLOPs (from the kernels' products): forward `2 B H T_p (3KV + 32(3.25K + 2K + 4V)/2 + 0.3125 * 64^2 / 2)`, i.e.
  `B H T_p (6KV + 64(5.25K + 4V) + 0.625 * 64^2)`; backward `B H T_p (16KV + 64(18K + 8V + 2V ceil(K/128)) + 4 * 64^2)`.

GatedDeltaNet, one decoded token (fla's `fused_recurrent_gated_delta_rule`): `o` (`[B, 1, H, V]` in) and a new final
state (`[B, H, K, V]` fp32); `B H (7KV + 2V + 7K ceil(V/8))` FLOPs; no backward.

TRL's fused LM head folds (`_forward_kernel`, `_backward_kernel`): each folds one `[tokens, vocab chunk]` tile of
logits into running per-token statistics, or turns it into the logits' gradient, in place: nothing is allocated;
about 6 FLOPs per tile entry. The tile's GEMMs around them are torch's own and run as they are.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import register_flop_formula

from .tracker import register_workspace

CHUNK = 64  # fla's chunk
TILING = 128  # fla's CONST_TILING on Hopper and Blackwell (and Ampere with 16-bit inputs)
FOLD_FLOPS_PER_ENTRY = 6
FP32 = torch.float32
NAMESPACE = "longstraw_sim"


def _geometry(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    batch, tokens, k_heads, key_dim = q.shape
    heads, value_dim = v.shape[2], v.shape[3]
    return batch, tokens, k_heads, heads, key_dim, value_dim, -(-tokens // CHUNK)


# -- GatedDeltaNet, chunked: forward -----------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_delta_rule_chunk", mutates_args=())
def gated_delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, output_final_state: bool
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(o, final state or an empty tensor, normalised q, q's reciprocal norms, normalised k, k's, cumulative gate,
    A): fla's chunked forward's returned and saved tensors. Fake only: a simulation never runs it."""
    raise NotImplementedError("a stand-in kernel: only its fake implementation runs, in a simulation")


@gated_delta_rule_chunk.register_fake
def _(q, k, v, g, beta, output_final_state):
    batch, tokens, k_heads, heads, key_dim, value_dim, _ = _geometry(q, v)
    final = q.new_empty((batch, heads, key_dim, value_dim) if output_final_state else (0,), dtype=FP32)
    return (
        v.new_empty(batch, tokens, heads, value_dim),
        final,
        q.new_empty(batch, tokens, k_heads, key_dim),
        q.new_empty(batch, tokens, k_heads, dtype=FP32),
        k.new_empty(batch, tokens, k_heads, key_dim),
        k.new_empty(batch, tokens, k_heads, dtype=FP32),
        g.new_empty(batch, tokens, heads, dtype=FP32),
        k.new_empty(batch, tokens, heads, CHUNK),
    )


@register_flop_formula(torch.ops.longstraw_sim.gated_delta_rule_chunk, get_raw=True)
def _chunk_forward_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    batch, _, _, heads, key_dim, value_dim, chunks = _geometry(q, v)
    per_token = 6 * key_dim * value_dim + CHUNK * (5.25 * key_dim + 4 * value_dim) + 0.625 * CHUNK**2
    return int(batch * heads * chunks * CHUNK * per_token)


@register_workspace(torch.ops.longstraw_sim.gated_delta_rule_chunk)
def _chunk_forward_workspace(q, k, v, *args, **kwargs) -> int:
    """w, u, v_new and the chunk states h, alive together while `chunk_fwd_o` runs."""
    batch, tokens, _, heads, key_dim, value_dim, chunks = _geometry(q, v)
    size = q.element_size()
    return size * batch * heads * (tokens * (key_dim + 2 * value_dim) + chunks * key_dim * value_dim)


# -- GatedDeltaNet, chunked: backward ----------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_delta_rule_chunk_backward", mutates_args=())
def gated_delta_rule_chunk_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, the starting state's gradient or an empty tensor). Fake only."""
    raise NotImplementedError("a stand-in kernel: only its fake implementation runs, in a simulation")


@gated_delta_rule_chunk_backward.register_fake
def _(d_out, q, k, v, beta, initial_state):
    batch, tokens, k_heads, heads, key_dim, value_dim, _ = _geometry(q, v)
    d_start = q.new_empty((batch, heads, key_dim, value_dim) if initial_state is not None else (0,), dtype=FP32)
    return (
        q.new_empty(batch, tokens, k_heads, key_dim),
        k.new_empty(batch, tokens, k_heads, key_dim),
        v.new_empty(batch, tokens, heads, value_dim),
        q.new_empty(batch, tokens, heads, dtype=FP32),
        beta.new_empty(batch, tokens, heads),
        d_start,
    )


@register_flop_formula(torch.ops.longstraw_sim.gated_delta_rule_chunk_backward, get_raw=True)
def _chunk_backward_flops(d_out, q, k, v, *args, out_val=None, **kwargs) -> int:
    batch, _, _, heads, key_dim, value_dim, chunks = _geometry(q, v)
    tilings = -(-key_dim // TILING)
    per_token = 16 * key_dim * value_dim + CHUNK * (18 * key_dim + 8 * value_dim + 2 * value_dim * tilings)
    return int(batch * heads * chunks * CHUNK * (per_token + 4 * CHUNK**2))


@register_workspace(torch.ops.longstraw_sim.gated_delta_rule_chunk_backward)
def _chunk_backward_workspace(d_out, q, k, v, *args, **kwargs) -> int:
    """At `chunk_bwd_dqkwg`: w, u, v_new, dv, dw, per-value-head dq and dk, h and dh, dg's partial sums."""
    batch, tokens, _, heads, key_dim, value_dim, chunks = _geometry(q, v)
    size = q.element_size()
    per_token = size * (4 * key_dim + 3 * value_dim) + 4 * -(-key_dim // TILING)
    return batch * heads * (tokens * per_token + 2 * size * chunks * key_dim * value_dim)


class GatedDeltaRuleChunk(torch.autograd.Function):
    """fla's `ChunkGatedDeltaRuleFunction` as a simulation sees it: its contiguous copies (`input_guard`), its saved
    tensors, its outputs."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, output_final_state: bool):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # input_guard: q and k die with the forward
        saved = gated_delta_rule_chunk(q, k, v, g, beta, output_final_state)
        ctx.save_for_backward(*saved[2:], v, beta, initial_state)
        ctx.starting_state = initial_state is not None
        out, final = saved[:2]
        return out, final if output_final_state else None

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, _, k, _, _, _, v, beta, initial_state = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, d_start = gated_delta_rule_chunk_backward(
            d_out.contiguous(), q, k, v, beta, initial_state if ctx.starting_state else None
        )
        return dq, dk, dv, dg, dbeta, d_start if ctx.starting_state else None, None


def chunk_gated_delta_rule(
    query,
    key,
    value,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    """fla's `chunk_gated_delta_rule` as transformers calls it (module docstring)."""
    if cu_seqlens is not None:
        raise NotImplementedError("packed sequences (cu_seqlens) are not simulated: LongStraw runs none")
    if not use_qk_l2norm_in_kernel:
        raise NotImplementedError("the stand-in follows transformers' call: q and k L2-normalised in the kernel")
    return GatedDeltaRuleChunk.apply(query, key, value, g, beta, initial_state, bool(output_final_state))


# -- GatedDeltaNet, one decoded token ----------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_delta_rule_recurrent", mutates_args=())
def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, the new final state). Fake only."""
    raise NotImplementedError("a stand-in kernel: only its fake implementation runs, in a simulation")


@gated_delta_rule_recurrent.register_fake
def _(q, k, v, g, beta):
    batch, tokens, _, heads, key_dim, value_dim, _ = _geometry(q, v)
    return v.new_empty(batch, tokens, heads, value_dim), q.new_empty(batch, heads, key_dim, value_dim, dtype=FP32)


@register_flop_formula(torch.ops.longstraw_sim.gated_delta_rule_recurrent, get_raw=True)
def _recurrent_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    batch, tokens, _, heads, key_dim, value_dim, _ = _geometry(q, v)
    return batch * tokens * heads * (7 * key_dim * value_dim + 2 * value_dim + 7 * key_dim * -(-value_dim // 8))


def fused_recurrent_gated_delta_rule(
    query, key, value, g=None, beta=None, initial_state=None, output_final_state=False, **kwargs
):
    """fla's `fused_recurrent_gated_delta_rule` (forward only): contiguous copies, then the kernel's outputs."""
    out, final = gated_delta_rule_recurrent(query.contiguous(), key.contiguous(), value.contiguous(), g, beta)
    return out, final if output_final_state else None


# -- TRL's fused LM head -----------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::logprob_tile_fold", mutates_args=("tile", "statistics"))
def logprob_tile_fold(tile: torch.Tensor, statistics: list[torch.Tensor]) -> None:
    """A tile of logits folded into per-token statistics (forward) or into its own gradient (backward), in place."""


@logprob_tile_fold.register_fake
def _(tile, statistics):
    return None


@register_flop_formula(torch.ops.longstraw_sim.logprob_tile_fold, get_raw=True)
def _fold_flops(tile, statistics, *args, out_val=None, **kwargs) -> int:
    return FOLD_FLOPS_PER_ENTRY * tile.numel()


class _TileFold:
    """A Triton kernel's `kernel[grid](tile, stride, *statistics, ...)` call, as the stand-in op."""

    def __getitem__(self, grid):
        def launch(tile, stride, *statistics, **constants):
            logprob_tile_fold(tile, [t for t in statistics if isinstance(t, torch.Tensor)])

        return launch


def install_trl_head_stand_ins() -> list[str]:
    """TRL's fused LM head as on a GPU with Triton: the compact path and its tile folds (module docstring)."""
    from trl.kernels import chunked_logprob

    chunked_logprob._TRITON_AVAILABLE = True
    chunked_logprob._forward_kernel = chunked_logprob._backward_kernel = _TileFold()
    if not hasattr(chunked_logprob, "triton"):  # the backward's grid names triton.cdiv
        chunked_logprob.triton = SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    return ["trl.kernels.chunked_logprob tile folds (Triton)"]


def install_model_stand_ins(model: torch.nn.Module) -> list[str]:
    """fla's GatedDeltaNet kernels in place of every GatedDeltaNet mixer's kernel functions (module docstring); the
    stand-ins installed, by name."""
    replaced = set()
    for module in model.modules():
        kernels = getattr(module, "_kernel_funcs", None) or {}
        for name, stand_in in (
            ("chunk_gated_delta_rule", chunk_gated_delta_rule),
            ("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule),
        ):
            if name in kernels:
                kernels[name].forward = _bound(stand_in, kernels[name])
                replaced.add(f"fla.{name} (Triton)")
    return sorted(replaced)


def _bound(function, kernel):
    """`function` as the kernel function's bound forward (as `kernels.kernelize` sets one)."""

    def forward(module, *args, **kwargs):
        return function(*args, **kwargs)

    return types.MethodType(forward, kernel)
