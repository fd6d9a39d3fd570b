"""LoRA on fused MoE experts without merged weights: the `longstraw` experts implementation.

transformers 5 stores a MoE layer's routed experts as two fused tensors (`gate_up_proj`, `down_proj`:
`[experts, out, in]`), and PEFT (0.21) adapts them with LoRA on parameters: its `ParamWrapper` parametrizes each
tensor as `W + scaling * lhs @ rhs` for the length of a forward. Every expert forward then materialises the whole
merged stack (one `baddbmm` the size of all experts' weights), and its backward the gradient of that stack, though a
forward reads each expert only for the tokens routed to it. On GLM-5 (256 experts of 6,144 x 2,048) that is 18 GiB
per layer per forward and again per backward, beside the layer FSDP2 gathers (docs/simulation.md#the-papers-runs).

The low-rank update is linear in the input, so it is applied to the routed tokens instead:
`x @ (W + s A B)^T = x @ W^T + s (x @ B^T) @ A^T` per expert, each product a grouped matmul over the tokens sorted by
expert (transformers' `grouped_mm` path, reused), the LoRA factors read from PEFT's own parametrization. Nothing the
size of the expert stack is kept through the forward or differentiated in the backward (what remains is torch's
check as PEFT registers the parametrization: it evaluates it once and frees it; the planner counts it). The
adapters' values and gradients are PEFT's, and a
forward without an active single adapter (the reference pass with adapters disabled, several adapters, a low-precision
stack PEFT upcasts) reads the parameter as transformers does.

Registered in transformers' `ExpertsInterface` and chosen by [`~trl_longstraw.engine.prepare_model`] for a model
whose fused experts carry LoRA (`lora_experts`); every other model keeps transformers' choice.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from transformers.integrations.moe import ExpertsInterface
from transformers.integrations.moe import _grouped_linear as grouped_linear

try:  # PEFT's parametrization holding one adapter's low-rank factors (peft.tuners.lora.layer, 0.21)
    from peft.tuners.lora.layer import _LoraFactorsProxy
except ImportError:  # a PEFT without it: every parameter is read as transformers reads it
    _LoraFactorsProxy = None

EXPERTS_IMPLEMENTATION = "longstraw"


def _weight_and_factors(
    experts: nn.Module, name: str
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, float] | None]:
    """The fused tensor `name` of `experts` without its LoRA, and the LoRA's `(lhs, rhs, scaling)` (its update is
    `scaling * lhs @ rhs` in the tensor's layout), when PEFT parametrizes it with one adapter's factors and nothing
    else. Otherwise `(the parameter as transformers reads it, None)`."""
    parametrizations = getattr(experts, "parametrizations", None)
    if _LoraFactorsProxy is not None and parametrizations is not None and name in parametrizations:
        chain = parametrizations[name]
        if len(chain) == 1 and isinstance(chain[0], _LoraFactorsProxy):
            proxy = chain[0]
            return chain.original, (proxy.lhs, proxy.rhs, proxy.scaling)
    return getattr(experts, name), None


def _expert_linear(
    experts: nn.Module, name: str, inputs: torch.Tensor, expert_ids: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """`inputs` (sorted by expert: `expert_ids` per row, `offsets` the groups' ends) through each row's expert's
    `name` map, with its LoRA applied to the rows: the base product and the two thin ones, all grouped."""
    weight, factors = _weight_and_factors(experts, name)
    out = grouped_linear(inputs, weight, offsets, is_transposed=experts.is_transposed)
    if factors is not None:
        lhs, rhs, scaling = factors
        lhs, rhs = _aligned_factors(lhs, rhs)
        # [E, out, in] = lhs [E, out, r] @ rhs [E, r, in]: x @ W^T gains s (x @ rhs^T) @ lhs^T;
        # [E, in, out] (transposed layout) = lhs [E, in, r] @ rhs [E, r, out]: x @ W gains s (x @ lhs) @ rhs.
        first, second = (lhs, rhs) if experts.is_transposed else (rhs, lhs)
        inner = grouped_linear(inputs.to(first.dtype), first, offsets, is_transposed=experts.is_transposed)
        out = out + scaling * grouped_linear(inner, second, offsets, is_transposed=experts.is_transposed)
    if experts.has_bias:
        out = out + getattr(experts, f"{name}_bias")[expert_ids]
    return out


def _aligned_factors(lhs: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's factors (`lhs [E, *, r]`, `rhs [E, r, *]`, views in its own layout) as contiguous tensors whose rank is
    padded with zeros to a multiple of 16 bytes: grouped GEMMs need each matrix's strides in 16-byte multiples (a rank
    of 4 in bf16 is 8 bytes). Zero columns add nothing to the product and receive no gradient; the copies are
    rank-sized (E x r x (in + out))."""
    multiple = 16 // lhs.element_size()
    pad = -lhs.shape[-1] % multiple
    return nn.functional.pad(lhs, (0, pad)).contiguous(), nn.functional.pad(rhs, (0, 0, 0, pad)).contiguous()


def longstraw_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` (same routing, gate, weighting and fp32 sum over the top k) with
    each fused map applied by `_expert_linear`. Expert parallelism's sentinel rows are not supported: LongStraw
    shards experts with FSDP2, not EP."""
    if self._is_expert_parallel:
        raise NotImplementedError(
            "The `longstraw` experts implementation does not run expert-parallel layers; LongStraw shards experts "
            "with FSDP2 (shard_weights=True)."
        )
    num_tokens, hidden_dim = hidden_states.shape[0], hidden_states.shape[-1]
    num_top_k = top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[order // num_top_k]
    # histc, as transformers: bincount's output size depends on the data (no CUDA graphs); CPU's histc needs floats
    counts_input = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
    per_expert = torch.histc(counts_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)

    projected = _expert_linear(self, "gate_up_proj" if self.has_gate else "up_proj", rows, expert_ids, offsets)
    projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    projected = _expert_linear(self, "down_proj", projected, expert_ids, offsets)
    if self.has_post_expert_norm:
        projected = self.post_expert_norm(projected)
    weighted = projected * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.shape[0], device=order.device)
    summed = weighted[restore].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return summed.to(hidden_states.dtype)


def register_experts() -> None:
    """Register the `longstraw` experts implementation with transformers (idempotent)."""
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, longstraw_experts_forward)


def lora_experts(model: nn.Module) -> bool:
    """Whether PEFT's LoRA adapts a fused expert tensor of `model` (a `ParamWrapper` around an experts module that
    dispatches through transformers' `ExpertsInterface`)."""
    # `use_experts_implementation` gives every experts class it dispatches a `_apply_gate`
    return any(
        isinstance(module, ParamWrapper) and hasattr(module.get_base_layer(), "_apply_gate")
        for module in model.modules()
    )
