"""Driving TRL's own GRPO loss on leaf log-probs, and the per-token gradients each replay back-propagates.

Every TRL loss type decomposes over members once its batch-level normalisers are known. Rather than re-implementing
eight loss types, LongStraw computes every member's log-probs (and entropies) without grad from the captured state,
runs `GRPOTrainer._compute_loss` once on leaf tensors standing in for them, and takes `d loss / d logp`. Each member
is then replayed under autograd and back-propagates `logp_i.backward(d loss / d logp_i)`. Same loss, same metrics,
same normalisers as stock, and future TRL loss types come for free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossLeaves:
    """Leaf stand-ins for the model outputs `GRPOTrainer._compute_loss` reads, `[batch, completion_len]` each."""

    logps: torch.Tensor
    entropies: torch.Tensor

    @classmethod
    def from_scores(cls, logps: torch.Tensor, entropies: torch.Tensor) -> LossLeaves:
        return cls(logps.detach().requires_grad_(True), entropies.detach().requires_grad_(True))

    def model_outputs(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """What `_get_per_token_logps_and_entropies` returns while the loss runs on the leaves (no MoE aux loss)."""
        return self.logps, self.entropies, None

    def gradients(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`d loss / d logps` and `d loss / d entropies` (None when the loss does not use entropies' values)."""
        grad_logps, grad_entropies = torch.autograd.grad(loss, [self.logps, self.entropies], allow_unused=True)
        if grad_logps is None:
            grad_logps = torch.zeros_like(self.logps)
        return grad_logps, grad_entropies


def member_backward(
    logps: torch.Tensor,
    entropies: torch.Tensor | None,
    grad_logps: torch.Tensor,
    grad_entropies: torch.Tensor | None,
) -> None:
    """Back-propagate one replayed member's share of the loss into the parameters (and the prompt-state leaves)."""
    outputs, grads = [logps], [grad_logps.to(logps.dtype)]
    if grad_entropies is not None:
        if entropies is None:
            raise RuntimeError("the loss uses entropies but the model's fused LM head does not compute them")
        outputs.append(entropies)
        grads.append(grad_entropies.to(entropies.dtype))
    torch.autograd.backward(outputs, grads)
