"""Driving TRL's own GRPO loss from scored log-probs, and the per-token gradients each replay back-propagates.

Every TRL loss type decomposes over members once its batch-level normalisers are known. Rather than re-implementing
eight loss types, LongStraw scores every member's log-probs (and entropies) without grad from the captured prompt
state and hands them to `GRPOTrainer._compute_loss` as the outputs of one autograd node, [`ReplayedScores`]. TRL's
loss runs on them unchanged (same value, same metrics, same normalisers; future loss types come for free); when the
loss is back-propagated, autograd delivers `d loss / d logp` per token to that node, whose backward replays each
member under autograd and calls `logp_i.backward(d loss / d logp_i)`. So `trainer.compute_loss(model, inputs)
.backward()` — what `Trainer.training_step` does — gives the LongStraw gradient, with no full forward of
`prompt + completion` under autograd anywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ReplayBackward = Callable[[torch.Tensor | None, torch.Tensor | None], None]


class ReplayedScores(torch.autograd.Function):
    """Scored `(logps, entropies)` as a differentiable node whose backward is the serial replay.

    `forward(replay_backward, anchor, logps, entropies)`: `logps`/`entropies` are `[batch, completion_len]` no-grad
    scores; `anchor` is any tensor that requires grad (it only makes the outputs part of the graph). `backward` calls
    `replay_backward(grad_logps, grad_entropies)` with grad enabled; a gradient is None when the loss does not use
    that output (TRL uses entropies' values only for an entropy bonus).
    """

    @staticmethod
    def forward(ctx, replay_backward: ReplayBackward, anchor, logps, entropies):
        ctx.replay_backward = replay_backward
        ctx.set_materialize_grads(False)
        return logps.clone(), entropies.clone()

    @staticmethod
    def backward(ctx, grad_logps, grad_entropies):
        with torch.enable_grad():
            ctx.replay_backward(grad_logps, grad_entropies)
        return None, None, None, None


def replayed_scores(
    replay_backward: ReplayBackward, logps: torch.Tensor, entropies: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logps`, `entropies` as outputs of a [`ReplayedScores`] node (see there)."""
    anchor = torch.zeros((), device=logps.device, requires_grad=True)
    return ReplayedScores.apply(replay_backward, anchor, logps, entropies)


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
