"""The MoE load-balancing loss, split where LongStraw splits the forward: the prompt once, each member apart.

`GRPOTrainer` adds `router_aux_loss_coef * aux_loss` to the loss of a MoE policy, where `aux_loss` is transformers'
`load_balancing_loss_func` over every unmasked token of the micro-batch's rows, prompt and completion, at every MoE
layer (Switch Transformer's loss, TRL's fused LM head calls Mixtral's copy, which every family shares):

    aux = E * sum_e (count_e / N) * (prob_e / N)

with `count_e` the number of (token, layer) top-k assignments to expert e, `prob_e` the sum of the router's softmax
probability of e and N the number of (token, layer) rows. All three are sums over tokens, so a micro-batch's loss is
exact from sums taken apart ([`RouterLoad`]): the group's prompt tokens once at capture (counted once per row that
shares the prompt, as stock's rows each carry the prompt), each member's own tokens at scoring. Only `prob_e` carries
a gradient (the counts come from a top-k), and `d aux / d prob_e = E * count_e / N^2` is a constant once the
micro-batch is scored: a replay back-propagates `sum_e w_e * prob_e` of its member's tokens, exact mode's prompt
backward that of the prompt's tokens, with `w` that constant times the loss's gradient ([`RouterLoad.weights`]).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoeRouting:
    """What the loss needs of the model: its number of experts and how many each token is routed to."""

    num_experts: int
    top_k: int


def moe_routing(model: nn.Module) -> MoeRouting:
    """The model's routing as TRL's fused LM head reads it (`num_experts`, `num_experts_per_tok` of the text config).

    Raises if the backbone does not return router logits (`output_router_logits`): the loss has nothing to sum.
    """
    config = model.config.get_text_config()
    backbone = model.base_model
    if "router_logits" not in (getattr(backbone, "_can_record_outputs", None) or {}):
        raise ValueError(
            f"router_aux_loss_coef != 0, but {type(backbone).__name__} does not return router logits "
            "(output_router_logits), so the MoE load-balancing loss cannot be computed. Set router_aux_loss_coef=0.0."
        )
    missing = [name for name in ("num_experts", "num_experts_per_tok") if not hasattr(config, name)]
    if missing:
        raise ValueError(
            f"router_aux_loss_coef != 0, but {type(config).__name__} has no {' or '.join(missing)}, which TRL's "
            "load-balancing loss reads (GRPOTrainer fails on it at the first loss). Set router_aux_loss_coef=0.0."
        )
    return MoeRouting(num_experts=int(config.num_experts), top_k=int(config.num_experts_per_tok))


@dataclass
class RouterLoad:
    """Sums over some tokens of a MoE forward: top-k assignments per expert, router probability per expert (with
    its graph where the forward had one) and the number of (token, layer) rows. fp32, like transformers' loss."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of(cls, router_logits: tuple[torch.Tensor, ...], routing: MoeRouting, mask: torch.Tensor) -> RouterLoad:
        """The sums over the tokens of one forward, `router_logits` one `[tokens, experts]` tensor per MoE layer and
        `mask` its `[batch, seq]` attention mask, as `load_balancing_loss_func` takes them (the same arithmetic)."""
        device = mask.device  # where the inputs are: each layer's logits are summed there (`device_map`)
        flat_mask = mask.reshape(-1).to(device=device, dtype=torch.float32)
        counts = torch.zeros(routing.num_experts, dtype=torch.float32, device=device)
        probs = torch.zeros(routing.num_experts, dtype=torch.float32, device=device)
        for layer_logits in router_logits:
            weights = torch.nn.functional.softmax(layer_logits.to(device), dim=-1)
            _, selected = torch.topk(weights, routing.top_k, dim=-1)
            counts = counts.scatter_add(0, selected.reshape(-1), flat_mask.repeat_interleave(routing.top_k))
            probs = probs + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
        return cls(counts, probs, flat_mask.sum() * len(router_logits))

    @classmethod
    def zeros(cls, routing: MoeRouting, device: torch.device) -> RouterLoad:
        """The sums over no token (a one-token prompt captures none)."""
        zeros = torch.zeros(routing.num_experts, dtype=torch.float32, device=device)
        return cls(zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=device))

    def __add__(self, other: RouterLoad) -> RouterLoad:
        return RouterLoad(self.counts + other.counts, self.probs + other.probs, self.rows + other.rows)

    def times(self, copies: int) -> RouterLoad:
        """The sums over `copies` rows that each carry these tokens (a prompt shared by `copies` members)."""
        return RouterLoad(self.counts * copies, self.probs * copies, self.rows * copies)

    def loss(self, routing: MoeRouting) -> torch.Tensor:
        """transformers' `load_balancing_loss_func` of the tokens summed here."""
        return torch.sum((self.counts / self.rows) * (self.probs.detach() / self.rows)) * routing.num_experts

    def weights(self, routing: MoeRouting, grad_loss: torch.Tensor) -> torch.Tensor:
        """`grad_loss * d loss / d probs` `[experts]`: what each token's router probabilities are back-propagated
        with (the counts and the row count are constants of the scored micro-batch)."""
        return grad_loss * routing.num_experts * (self.counts / self.rows) / self.rows

    def objective(self, weights: torch.Tensor) -> torch.Tensor:
        """`sum_e weights_e * probs_e`: a scalar whose backward (with gradient 1) is these tokens' share of the
        loss's gradient."""
        return (self.probs * weights.to(self.probs.device)).sum()


@contextmanager
def recorded_router_logits(backbone: nn.Module) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """The router logits every forward of `backbone` returns (called with `output_router_logits=True`) while open,
    one tuple per forward: TRL's fused LM head runs the backbone itself and keeps only its own aux loss."""
    recorded: list[tuple[torch.Tensor, ...]] = []

    def record(module, args, output):
        router_logits = getattr(output, "router_logits", None)
        if router_logits is not None:
            recorded.append(router_logits)

    handle = backbone.register_forward_hook(record)
    try:
        yield recorded
    finally:
        handle.remove()
