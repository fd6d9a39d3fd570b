"""`LongStrawGRPOTrainer`: `GRPOTrainer` whose scoring and update capture each group's prompt once.

TRL integration only: which rows form a group, where scoring and the update hook into `GRPOTrainer`, telemetry into
the trainer's metrics. The update of one group lives in `engine.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import is_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoConfig, TrainerCallback
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from .architectures import check_supported
from .attention import ATTENTION_IMPLEMENTATION, register_attention
from .config import LongStrawGRPOConfig
from .distributed import average_gradients
from .engine import LongStrawEngine, ensure_finite
from .loss import LossLeaves, member_backward
from .telemetry import PhaseTelemetry


@dataclass
class Group:
    """The rows of one group in a batch: one prompt, `len(rows)` completions."""

    index: int
    rows: range
    prompt_ids: torch.Tensor  # [P] real prompt tokens (left padding removed)
    first_position: int  # position of prompt_ids[0], as the padded full-sequence forward numbers it
    completion_lengths: torch.Tensor  # [G] real completion tokens per member


def split_groups(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    max_positions: int | None,
) -> list[Group]:
    """Cut a batch into groups of `group_size` consecutive rows that share a prompt; raise on anything else."""
    batch = prompt_ids.shape[0]
    if batch % group_size != 0:
        raise ValueError(
            f"The batch has {batch} rows, which is not a whole number of groups of num_generations={group_size}: "
            "LongStraw captures each group's prompt once. Make per_device_train_batch_size a multiple of "
            "num_generations."
        )
    total_length = prompt_ids.shape[1] + completion_mask.shape[1]
    if max_positions is not None and total_length > max_positions:
        raise ValueError(
            f"Prompt ({prompt_ids.shape[1]} tokens, padded) plus completion ({completion_mask.shape[1]} tokens) "
            f"spans {total_length} positions, more than the model's max_position_embeddings={max_positions}. "
            "Truncate the prompts, lower max_completion_length, or use a model configured for longer context."
        )
    groups = []
    for index in range(batch // group_size):
        rows = range(index * group_size, (index + 1) * group_size)
        prompts, masks = prompt_ids[rows.start : rows.stop], prompt_mask[rows.start : rows.stop]
        if not (
            torch.equal(prompts, prompts[:1].expand_as(prompts)) and torch.equal(masks, masks[:1].expand_as(masks))
        ):
            raise ValueError(
                f"Rows {rows.start}..{rows.stop - 1} (group {index}) do not share one prompt. LongStraw needs the "
                f"num_generations={group_size} completions of a prompt in consecutive rows with identical prompt_ids "
                "and prompt_mask (GRPOTrainer's own layout before shuffling)."
            )
        real = masks[0].bool()
        num_real = int(real.sum())
        first_position = prompts.shape[1] - num_real
        if num_real == 0 or not bool(real[first_position:].all()):
            raise ValueError(
                f"Group {index}: prompt_mask must be left-padded and non-empty (got {masks[0].tolist()})."
            )
        groups.append(
            Group(
                index,
                rows,
                prompts[0, first_position:],
                first_position,
                completion_mask[rows.start : rows.stop].sum(1),
            )
        )
    return groups


def shuffle_groups(batch: dict[str, Any], group_size: int) -> dict[str, Any]:
    """Shuffle whole groups (not rows, as TRL does) so every micro-batch cut from the batch holds whole groups."""
    num_rows = len(batch["prompt_ids"])
    order = torch.randperm(num_rows // group_size)
    rows = (order[:, None] * group_size + torch.arange(group_size)[None, :]).reshape(-1)

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[rows.to(value.device)]
        if isinstance(value, list) and len(value) == num_rows:
            return [value[i] for i in rows]
        return value

    return {key: permute(value) for key, value in batch.items()}


class _OptimizerPhaseCallback(TrainerCallback):
    """Times the optimizer step (a Trainer callback: the Trainer owns that call) into the trainer's metrics."""

    def __init__(self, trainer: LongStrawGRPOTrainer):
        self.trainer = trainer
        self.span = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.span = self.trainer._telemetry.phase("optimizer")
        self.span.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
            self.trainer._flush_telemetry()


class LongStrawGRPOTrainer(GRPOTrainer):
    """
    Drop-in [`~trl.GRPOTrainer`] for long shared prompts: each group's prompt is captured once without autograd,
    old/reference log-probs are scored from that capture, and each completion is replayed alone under autograd
    against the read-only prompt state. Peak memory is O(prompt state) + O(one completion's graph), independent
    of the group size; the prompt is computed once per group instead of once per member.

    Arguments are `GRPOTrainer`'s; `args` must be a [`LongStrawGRPOConfig`]. See `replay_and_backward` for the
    update contract.
    """

    _tag_names = ["trl", "grpo", "longstraw"]

    def __init__(self, model, reward_funcs=None, args: LongStrawGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = LongStrawGRPOConfig(f"{name.split('/')[-1]}-LongStraw-GRPO")
        if not isinstance(args, LongStrawGRPOConfig):
            raise TypeError(
                f"args is a {type(args).__name__}; LongStrawGRPOTrainer needs a LongStrawGRPOConfig (it accepts every "
                "GRPOConfig field): LongStrawGRPOConfig(**your_grpo_config.to_dict())."
            )
        if args.fp16:
            raise ValueError(
                "fp16=True is not supported: the per-member backward bypasses the fp16 loss scaler. Use bf16=True."
            )
        if isinstance(model, str):  # fail on an unsupported architecture before loading any weights
            init_kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}
            check_supported(AutoConfig.from_pretrained(model, trust_remote_code=init_kwargs.get("trust_remote_code")))
        else:
            check_supported(model.config)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        if self._is_vlm:
            raise ValueError("LongStrawGRPOTrainer supports text-only causal LMs; this model is vision-language.")
        if self.aux_loss_enabled:
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef}: the MoE load-balancing loss is computed over "
                "every token of prompt + completion, which LongStraw never runs together under autograd. Set "
                "router_aux_loss_coef=0.0 (routing itself is replayed exactly)."
            )
        register_attention()
        for policy_or_ref in (self._causal_lm(self.model), self.ref_model):
            if policy_or_ref is not None:
                self.accelerator.unwrap_model(policy_or_ref).set_attn_implementation(ATTENTION_IMPLEMENTATION)
        state_device = None if args.prompt_state_device == "auto" else torch.device(args.prompt_state_device)
        self.engine = LongStrawEngine(
            prefill_chunk_size=args.prefill_chunk_size,
            attention_chunk_size=args.attention_chunk_size,
            state_device=state_device,
            prompt_gradient=args.prompt_gradient,
        )
        self._telemetry = PhaseTelemetry(self.accelerator.device, enabled=args.log_phase_metrics)
        self._loss_leaves: LossLeaves | None = None
        self.add_callback(_OptimizerPhaseCallback(self))

    # ---------------------------------------------------------------------------------------------------------------
    # Helpers
    # ---------------------------------------------------------------------------------------------------------------
    def _causal_lm(self, model):
        """The causal LM that carries the fused LM head: DDP unwrapped, PEFT's injected base model."""
        model = self.accelerator.unwrap_model(model)
        return model.get_base_model() if is_peft_model(model) else model

    def _group_size(self) -> int:
        return self.num_generations if self.model.training else self.num_generations_eval

    def _groups(self, prompt_ids, prompt_mask, completion_mask) -> list[Group]:
        max_positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return split_groups(prompt_ids, prompt_mask, completion_mask, self._group_size(), max_positions)

    def _is_reference_pass(self, model) -> bool:
        """Whether GRPOTrainer is scoring the reference: `ref_model`, or the policy with its adapter disabled/`ref`."""
        if self.ref_model is not None:
            return self.accelerator.unwrap_model(model) is self.accelerator.unwrap_model(self.ref_model)
        policy = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(policy):
            return False
        if policy.active_adapter == "ref":
            return True
        tuner = next((m for m in policy.modules() if isinstance(m, BaseTunerLayer)), None)
        return tuner is not None and tuner.disable_adapters

    def _flush_telemetry(self) -> None:
        mode = "train" if self.model.training else "eval"
        for key, value in self._telemetry.flush().items():
            self._metrics[mode][key].append(value)

    def _capture(self, causal_lm, group: Group, phase: str):
        with self._telemetry.phase(phase), self.accelerator.autocast():
            state = self.engine.capture(causal_lm, group.prompt_ids, group.first_position)
        self._telemetry.record_state(state.nbytes())
        return state

    def _capture_and_score(self, causal_lm, group: Group, completion_ids, capture_phase: str):
        """Capture a group's prompt, then score its members without grad; returns the state and the scores.

        Members are scored one at a time, like they are replayed: batching them would make the scoring peak grow
        with the group size (measured: 0.16 to 0.85 GiB from G = 2 to 16 at P = 8K), breaking the memory contract.
        """
        state = self._capture(causal_lm, group, capture_phase)
        with self._telemetry.phase("score"), torch.no_grad(), self.accelerator.autocast():
            logps, entropies = self.engine.score(
                causal_lm,
                state,
                group.prompt_ids[-1:],
                completion_ids[group.rows.start : group.rows.stop],
                group.completion_lengths,
                batch_size=1,
            )
        for member, values in enumerate(logps):
            ensure_finite(values, f"phase 'score' ({capture_phase}), group {group.index}, member {member}")
        return state, logps, entropies

    # ---------------------------------------------------------------------------------------------------------------
    # Scoring: GRPOTrainer asks for per-token log-probs; they come from one capture per group
    # ---------------------------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal_inputs,
    ):
        if self._loss_leaves is not None:  # GRPOTrainer._compute_loss running on leaves inside replay_and_backward
            return self._loss_leaves.model_outputs()
        if torch.is_grad_enabled():
            raise RuntimeError(
                "LongStrawGRPOTrainer computes gradients only through replay_and_backward (training_step calls it); "
                "a grad-enabled full forward of prompt + completion is exactly what it exists to avoid."
            )
        if any(value is not None for value in multimodal_inputs.values()):
            raise ValueError("LongStrawGRPOTrainer supports text-only inputs; got multimodal tensors.")
        completion_ids = input_ids[:, -logits_to_keep:]
        groups = self._groups(
            input_ids[:, :-logits_to_keep], attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
        )
        causal_lm = self._causal_lm(model)
        phase = "capture_ref" if self._is_reference_pass(model) else "capture"
        logps, entropies = [], []
        for group in groups:
            state, group_logps, group_entropies = self._capture_and_score(causal_lm, group, completion_ids, phase)
            del state  # one group's state alive at a time
            logps.append(group_logps)
            entropies.append(group_entropies)
        entropies = torch.cat(entropies) if compute_entropy else None
        return torch.cat(logps), entropies, None

    # ---------------------------------------------------------------------------------------------------------------
    # The update
    # ---------------------------------------------------------------------------------------------------------------
    def replay_and_backward(self, model, inputs: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """Capture each group once, replay its members serially under autograd, `backward()` per member.

        `inputs` is what `GRPOTrainer._generate_and_score_completions` returns, the `num_generations` rows of each
        group consecutive. Returns the detached loss, equal to `GRPOTrainer.compute_loss(model, inputs)`. With
        `prompt_gradient="exact"` the accumulated `.grad` equals `compute_loss(...).backward()`'s; with "detach",
        that of the same loss with the prompt state held constant.
        """
        causal_lm = self._causal_lm(model)
        completion_ids = inputs["completion_ids"]
        groups = self._groups(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_mask"])

        # 1. Capture each group and score its members without grad; only the last group's state stays alive.
        scores, state = [], None
        for group in groups:
            del state
            state, *group_scores = self._capture_and_score(causal_lm, group, completion_ids, "capture")
            scores.append(group_scores)
        logps = torch.cat([group_logps for group_logps, _ in scores])
        entropies = torch.cat([group_entropies for _, group_entropies in scores])

        # 2. TRL's own loss on leaf log-probs: the loss value, its metrics, and d loss / d logp per token.
        self._loss_leaves = LossLeaves.from_scores(logps, entropies)
        try:
            loss = super().compute_loss(model, inputs)
        finally:
            leaves, self._loss_leaves = self._loss_leaves, None
        ensure_finite(loss.detach(), "the GRPO loss computed from the scored log-probs")
        grad_logps, grad_entropies = leaves.gradients(loss)

        # 3. Replay members one at a time (last group first: its state is still alive), backward each.
        for group in reversed(groups):
            rows = group.rows
            member_grads_zero = not grad_logps[rows.start : rows.stop].any() and (
                grad_entropies is None or not grad_entropies[rows.start : rows.stop].any()
            )
            if member_grads_zero:  # e.g. all-equal rewards with beta=0: the group contributes no gradient
                state = None
                continue
            if state is None:
                state = self._capture(causal_lm, group, "capture")
            if self.args.prompt_gradient == "exact":
                state.requires_grad_()
            for member, row in enumerate(rows):
                length = int(group.completion_lengths[member])
                if length == 0:
                    continue
                with self._telemetry.phase("replay"), self.accelerator.autocast():
                    member_logps, member_entropies = self.engine.replay(
                        causal_lm, state, group.prompt_ids[-1:], completion_ids[row], length
                    )
                    ensure_finite(member_logps.detach(), f"phase 'replay', group {group.index}, member {member}")
                    member_backward(
                        member_logps,
                        member_entropies,
                        grad_logps[row, :length],
                        None if grad_entropies is None else grad_entropies[row, :length],
                    )
            if self.args.prompt_gradient == "exact":
                with self._telemetry.phase("prompt_backward"), self.accelerator.autocast():
                    self.engine.backward_prompt(causal_lm, state, group.prompt_ids)
            state = None
        if self.accelerator.sync_gradients:
            average_gradients(causal_lm)
        return loss.detach()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """`Trainer.training_step` with `replay_and_backward` in place of `compute_loss` + `backward`."""
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.replay_and_backward(model, inputs)
        del inputs
        # GRPOTrainer.training_step's bookkeeping
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        self._flush_telemetry()
        return loss

    def _prepare_inputs(self, generation_batch):
        """GRPOTrainer's buffering, with groups shuffled whole so no micro-step splits a group."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = shuffle_groups(batch, self.num_generations)
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]
