"""Driving TRL's own GRPO loss from scored log-probs, and the per-token gradients each replay back-propagates.

Every TRL loss type decomposes over members once its batch-level normalisers are known. Rather than re-implementing
eight loss types, LongStraw scores every member's log-probs (and entropies) without grad from the captured prompt
state and hands them to `GRPOTrainer._compute_loss` as the outputs of one autograd node, [`ReplayedScores`]. TRL's
loss runs on them unchanged (same value, same metrics, same normalisers; future loss types come for free); when the
loss is back-propagated, autograd delivers `d loss / d logp` per token to that node, whose backward replays each
member under autograd and calls `logp_i.backward(d loss / d logp_i)`. So `trainer.compute_loss(model, inputs)
.backward()` — what `Trainer.training_step` does — gives the LongStraw gradient, with no full forward of
`prompt + completion` under autograd anywhere. A MoE policy's load-balancing loss (`aux_loss`, computed from the
scored router loads: load_balancing.py) is a third output of the same node, and its gradient a third argument of the
replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ReplayBackward = Callable[[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], None]


class ReplayedScores(torch.autograd.Function):
    """Scored `(logps, entropies, aux_loss)` as a differentiable node whose backward is the serial replay.

    `forward(replay_backward, anchor, logps, entropies, aux_loss)`: `logps`/`entropies` are `[batch, completion_len]`
    no-grad scores, `aux_loss` a no-grad scalar; `anchor` is any tensor that requires grad (it only makes the outputs
    part of the graph). `backward` calls `replay_backward(grad_logps, grad_entropies, grad_aux_loss)` with grad
    enabled; a gradient is None when the loss does not use that output (TRL uses entropies' values only for an
    entropy bonus).
    """

    @staticmethod
    def forward(ctx, replay_backward: ReplayBackward, anchor, logps, entropies, aux_loss):
        ctx.replay_backward = replay_backward
        ctx.set_materialize_grads(False)
        return logps.clone(), entropies.clone(), aux_loss.clone()

    @staticmethod
    def backward(ctx, grad_logps, grad_entropies, grad_aux_loss):
        with torch.enable_grad():
            ctx.replay_backward(grad_logps, grad_entropies, grad_aux_loss)
        return None, None, None, None, None


def replayed_scores(
    replay_backward: ReplayBackward,
    logps: torch.Tensor,
    entropies: torch.Tensor,
    aux_loss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`logps`, `entropies` (and `aux_loss`, if given) as outputs of a [`ReplayedScores`] node (see there)."""
    anchor = torch.zeros((), device=logps.device, requires_grad=True)
    given = torch.zeros((), device=logps.device) if aux_loss is None else aux_loss
    logps, entropies, given = ReplayedScores.apply(replay_backward, anchor, logps, entropies, given)
    return logps, entropies, None if aux_loss is None else given


def loss_pairs(
    logps: torch.Tensor, entropies: torch.Tensor | None, grad_logps: torch.Tensor, grad_entropies: torch.Tensor | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, gradient) pairs of replayed log-probs (and entropies, where the loss reads them) with the loss's
    gradients, moved to the LM head's device (under `device_map` not the loss's)."""
    pairs = [(logps, grad_logps.to(logps))]
    if grad_entropies is not None:
        if entropies is None:
            raise RuntimeError("the loss uses entropies but the model's fused LM head does not compute them")
        pairs.append((entropies, grad_entropies.to(entropies)))
    return pairs


def member_backward(
    logps: torch.Tensor,
    entropies: torch.Tensor | None,
    grad_logps: torch.Tensor,
    grad_entropies: torch.Tensor | None,
    router_objective: torch.Tensor | None = None,
) -> None:
    """Back-propagate one replayed member's share of the loss into the parameters (and the prompt-state leaves);
    `router_objective` is its tokens' share of the load-balancing loss (`RouterLoad.objective`), back-propagated
    with gradient 1."""
    pairs = loss_pairs(logps, entropies, grad_logps, grad_entropies)
    if router_objective is not None:
        pairs.append((router_objective, torch.ones_like(router_objective)))
    torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
