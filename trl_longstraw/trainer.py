"""`LongStrawGRPOTrainer`: `GRPOTrainer` whose scoring and update capture each prompt once.

TRL integration only: which rows share a prompt, where scoring and the update hook into `GRPOTrainer`, telemetry into
the trainer's metrics. The work on one prompt lives in `engine.py`.

The trainer overrides no step of TRL's loop: `Trainer.training_step`, `GRPOTrainer._prepare_inputs` (its row
shuffle, its split into micro-steps, its buffering) and `GRPOTrainer.compute_loss` run as stock. LongStraw enters at
one seam, `_get_per_token_logps_and_entropies`: under no grad it returns log-probs scored from captures; under grad
it returns them as the outputs of a [`~trl_longstraw.loss.ReplayedScores`] node, so the `backward()` that
`Trainer.training_step` calls on TRL's loss runs the serial replay. Same samples, same loss, same gradient as stock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from datetime import timedelta
from typing import Any, ClassVar

import torch
from accelerate.utils import is_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context, profiling_decorator
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from .callbacks import OptimizerStepCallback, PhaseChartsCallback
from .config import LongStrawGRPOConfig
from .context_parallel import (
    SharedRowsSampler,
    check_prompt_length,
    check_same_rewards,
    check_same_rows,
    distribution_over,
    leader_rows,
    share_leader_inputs,
)
from .distributed import average_gradients
from .engine import LongStrawEngine, prepare_model, stock_attention, weights_version
from .faults import OutputFiniteness, collective, first_non_finite_gradient, in_phase, warn_non_finite
from .fsdp import ShardedPasses, parallelize, receive_first_rank_weights, sharded_loading_kwargs
from .groups import KeptPromptState, PromptGroup, group_rows_by_prompt
from .load_balancing import moe_routing
from .loss import member_backward, replayed_scores
from .parallel_layout import ParallelLayout
from .plan import explain_out_of_memory, memory_budget, plan_at_construction, trainer_setup
from .preemption import PreemptionCallback
from .preflight import check_capture_matches_own_forward, positions_follow_mask
from .rollout import (
    PromptRows,
    ToolTurnStates,
    UnsupportedRolloutError,
    check_generation_config,
    decode,
    generates_with_transformers,
    prepare_sampling,
)
from .telemetry import PhaseTelemetry
from .validation import (
    check_device_map,
    check_dropout_off,
    check_eval_dataset,
    check_model,
    check_positions,
    check_sharded_checkpointing,
    check_trainer_args,
)

logger = logging.getLogger(__name__)


def model_devices(model) -> list[torch.device]:
    """The devices a model's weights occupy: one, or each of those a `device_map` split it over."""
    return sorted({param.device for param in model.parameters()}, key=str)


class LongStrawGRPOTrainer(GRPOTrainer):
    """
    Drop-in [`~trl.GRPOTrainer`] for long shared prompts: each prompt is captured once without autograd, old/reference
    and current log-probs are scored from that capture, and each completion is replayed alone under autograd against
    the read-only prompt state. Peak memory is O(prompt state) + O(one completion's graph), independent of the group
    size.

    Arguments are `GRPOTrainer`'s; `args` must be a [`LongStrawGRPOConfig`]. TRL's loop runs unchanged (see the module
    docstring): `compute_loss(model, inputs)` returns TRL's loss, and its `backward()` replays the completions.

    Prompt states and micro-steps: TRL's row shuffle spreads a group over the micro-steps of a generation batch. Each
    micro-step captures the prompts of its own rows: once to score them (forward) and once more to replay them
    (backward), except that the last state scored stays alive for the first replay, and the last state replayed stays
    alive for the next micro-step, which reuses it if its rows share that prompt and the weights have not moved.
    Nothing else is kept: at most one group's state is alive at a time, plus the one being captured. Captures per
    micro-step are logged as `longstraw/capture/count`; a whole group per micro-step (`per_device_train_batch_size` a
    multiple of `num_generations` and `steps_per_generation=1`) costs the fewest.
    """

    _tag_names: ClassVar[list[str]] = ["trl", "grpo", "longstraw"]

    def __init__(self, model, reward_funcs=None, args: LongStrawGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = LongStrawGRPOConfig(f"{name.split('/')[-1]}-LongStraw-GRPO")
        check_trainer_args(args)
        # What the config adopted from the launcher (config.py), before a model loads and the Accelerator is built
        os.environ.update(args.launch_environment())
        if not isinstance(model, str):  # an FSDP launch's first-rank-only loading (fsdp.py)
            receive_first_rank_weights(model)
        config = check_model(model, args, kwargs.get("peft_config"))  # before any weights load
        if isinstance(model, str) and args.shard_weights:  # each rank loads only its shards, where it can
            args.model_init_kwargs = sharded_loading_kwargs(
                config, args, kwargs.get("quantization_config"), kwargs.get("peft_config")
            )
        check_positions(config, args, prompt_width=1)
        self._memory_plan = plan_at_construction(  # before any weights load
            config, model, args, kwargs.get("peft_config"), kwargs.get("quantization_config")
        )
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        for policy_or_ref in (self.model, self.ref_model):
            if policy_or_ref is not None:
                check_dropout_off(policy_or_ref)
                check_device_map(self._causal_lm(policy_or_ref))
        if self._is_vlm:
            raise ValueError("LongStrawGRPOTrainer supports text-only causal LMs; this model is vision-language.")
        policy = self._causal_lm(self.model)
        adapter_units = parallelize(policy, args.shard_weights, args.shard_layer_classes)  # FSDP2 (fsdp.py)
        if adapter_units is not None:
            check_sharded_checkpointing(args)
            # Trainer's flag for a model that owns its placement and gradient reduction: Accelerate neither wraps it
            # in DDP (which rejects DTensor parameters) nor shards it again.
            self.is_distributed_loading_by_transformers = True
        # TRL adds the MoE load-balancing loss over every token of prompt + completion: summed apart (load_balancing.py)
        routing = moe_routing(self._causal_lm(self.model)) if self.aux_loss_enabled else None
        for policy_or_ref in (self._causal_lm(self.model), self.ref_model):
            if policy_or_ref is not None:
                prepare_model(self.accelerator.unwrap_model(policy_or_ref))
        # Pre-flight (preflight.py): every layer reaches the prompt state, the scores from a capture are the model's
        # own, and how the model numbers positions.
        check_capture_matches_own_forward(self._causal_lm(self.model))
        self._positions_follow_mask = positions_follow_mask(self._causal_lm(self.model))
        # How the ranks divide the work (parallel_layout.py): CP groups, data parallelism, FSDP2's mesh.
        self.parallel_layout = ParallelLayout.build(
            args.context_parallel_size, policy, timedelta(seconds=args.ddp_timeout)
        )
        # Every rank ran the same pre-flight passes; from here on the ranks holding shards agree pass by pass.
        self._sharded = (
            ShardedPasses(
                policy,
                self.accelerator.device,
                self.parallel_layout.shard_group,
                self.parallel_layout.context_parallel,
                adapter_units,
            )
            if adapter_units is not None
            else None
        )
        state_device = None if args.prompt_state_device == "auto" else torch.device(args.prompt_state_device)
        self.engine = LongStrawEngine(
            prefill_chunk_size=args.prefill_chunk_size,
            attention_chunk_size=args.attention_chunk_size,
            state_device=state_device,
            prompt_gradient=args.prompt_gradient,
            prompt_state_dtype=args.prompt_state_dtype,
            routing=routing,
            distribution=distribution_over(self.parallel_layout.cp_group),
            replay_segment_size=args.replay_segment_size,
        )
        self._telemetry = PhaseTelemetry(
            model_devices(self._causal_lm(self.model)),  # every GPU the weights occupy (several under `device_map`)
            enabled=args.log_phase_metrics,
            synchronize=args.sync_phase_metrics,
        )
        self._kept = KeptPromptState()  # one prompt state alive between uses (groups.py)
        self._prompt_tokens = 0  # the last prompt captured
        # which module a non-finite value came from (faults.py)
        self._finiteness = OutputFiniteness.of_causal_lm(policy)
        self._tool_turns = ToolTurnStates()  # a generation's first-turn states, for its tool turns (rollout.py)
        self._reached: list[torch.nn.Parameter] | None = None
        self.rollout_from_prompt_state = self._resolve_rollout(args)
        self._warned_own_generate = False
        if (
            self.parallel_layout.cp_group is not None and self.eval_dataset is not None
        ):  # refused now, not when evaluating
            for dataset in self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]:
                check_eval_dataset(dataset, self.parallel_layout.context_parallel, args, self.num_generations_eval)
        self.add_callback(OptimizerStepCallback(self._phase, self._after_optimizer_step))
        self.add_callback(PhaseChartsCallback(self._memory_plan))
        self.add_callback(PreemptionCallback())

    def _resolve_rollout(self, args: LongStrawGRPOConfig) -> bool:
        """Whether completions are decoded from the captured prompt state (`rollout_from_prompt_state`)."""
        if args.rollout_from_prompt_state is False or self.use_vllm or self.use_transformers_continuous_batching:
            return False
        try:
            check_generation_config(self._causal_lm(self.model), self.generation_config)
        except UnsupportedRolloutError as error:
            if args.rollout_from_prompt_state:
                raise
            logger.warning("Generating with transformers' generate, not from the prompt state: %s", error)
            return False
        return True

    def _rollout_reproduces_generate(self) -> bool:
        """Whether a rollout from the prompt state samples what GRPOTrainer's `generate` call would: not where the
        model's `generate` is not transformers' own (a model class with its own, a method replaced or patched after
        construction), which then generates, as in GRPOTrainer."""
        if generates_with_transformers(self.model, self._causal_lm(self.model)):
            return True
        message = (
            f"The model's generate is not transformers' own ({type(self._causal_lm(self.model)).__name__}.generate "
            "is replaced, patched or the model's own), and a rollout from the prompt state reproduces transformers' "
            "generate only"
        )
        if self.args.rollout_from_prompt_state:
            raise UnsupportedRolloutError(
                f"{message}. Set rollout_from_prompt_state=None (generate with the model's generate) or restore it."
            )
        if not self._warned_own_generate:
            logger.warning("%s: generating with it, as GRPOTrainer does.", message)
            self._warned_own_generate = True
        return False

    # ---------------------------------------------------------------------------------------------------------------
    # Helpers
    # ---------------------------------------------------------------------------------------------------------------
    def _causal_lm(self, model):
        """The causal LM that carries the fused LM head: DDP unwrapped, PEFT's injected base model."""
        model = self.accelerator.unwrap_model(model)
        return model.get_base_model() if is_peft_model(model) else model

    @contextlib.contextmanager
    def _sharded_phase(self, finish: bool = True):
        """A phase of the update whose passes differ between ranks: under FSDP2, every rank answers the others' passes
        when it ends, before the collectives that follow it (`ShardedPasses.finish_phase`)."""
        yield
        if finish and self._sharded is not None:
            self._sharded.finish_phase()

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Trainer's `no_sync` for an FSDP2 model it did not wrap. LongStraw keeps FSDP2's gradient sync off through the
        whole accumulation window and reduces once at its end (`ShardedPasses.reduce_gradients`): nothing to do."""
        yield

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save. Under FSDP2 every rank joins the gathering of the whole state dict, onto the first rank's
        host, which writes it (the other ranks get none)."""
        if self._sharded is not None and state_dict is None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(self.model, options=options)
        super()._save(output_dir, state_dict=state_dict)

    def _warn_non_finite(self, where: str, source: str | None = None) -> None:
        """`faults.warn_non_finite` in the optimizer step in progress; `source` by default the first module whose
        output was not finite since the last warning (`OutputFiniteness`)."""
        first = self._finiteness.first_non_finite()  # read (and reset) whether or not `source` names it
        warn_non_finite(where, self.state.global_step + 1, source or first)

    def _check_gradients(self) -> None:
        """Warn naming the first parameter whose gradient holds NaN or inf (`faults.first_non_finite_gradient`: one
        synchronisation per optimizer step, once the window's gradients are reduced)."""
        name = first_non_finite_gradient(self.model)
        if name is not None:
            self._warn_non_finite("the gradients", f"the gradient of {name}")

    def _check_members(
        self, finite: torch.Tensor, where: str, group: PromptGroup, members: list[int] | None = None
    ) -> None:
        """Warn naming the first member whose values are not finite (`finite`: one flag per member, or per
        `members`). One device synchronisation per group, not per member."""
        if not bool(finite.all()):
            member = int((~finite).nonzero()[0])
            member = member if members is None else members[member]
            self._warn_non_finite(f"{where}, group {group.index}, member {member}")

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    @contextlib.contextmanager
    def _phase(self, name: str):
        """A phase of the update: timed and metered (telemetry), and named by any failure in it (faults)."""
        with in_phase(name, self._explain_out_of_memory), self._telemetry.phase(name, self._mode()):
            yield

    def _explain_out_of_memory(self, phase: str) -> str:
        """An allocation failure's message (`plan.explain_out_of_memory`), at the prompt length last captured."""
        args, causal_lm = self.args, self._causal_lm(self.model)
        setup = trainer_setup(causal_lm.config, self.accelerator.unwrap_model(self.model), args)
        setup = dataclasses.replace(setup, prompt_tokens=max(self._prompt_tokens, 2))
        device = model_devices(causal_lm)[0]
        return explain_out_of_memory(
            causal_lm.config,
            setup,
            phase,
            self.parallel_layout.context_parallel,
            memory_budget(device, args.memory_plan_device_gib),
            args.per_device_train_batch_size,
            exact=args.prompt_gradient == "exact",
            weight_shards=self.parallel_layout.weight_shards,
        )

    def _after_optimizer_step(self) -> None:
        self._kept.invalidate()  # captured under the weights the optimizer just changed
        self._flush_telemetry("train")

    def _flush_telemetry(self, mode: str) -> None:
        for key, value in self._telemetry.flush(mode).items():
            self._metrics[mode][key].append(value)

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

    def _groups(self, prompt_ids, prompt_mask, completion_mask) -> list[PromptGroup]:
        max_positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return group_rows_by_prompt(
            prompt_ids, prompt_mask, completion_mask, max_positions, self._positions_follow_mask
        )

    # ---------------------------------------------------------------------------------------------------------------
    # Prompt states: capture, keep, reuse
    # ---------------------------------------------------------------------------------------------------------------
    def _capture(self, causal_lm, group: PromptGroup, phase: str):
        with self._phase(phase), self.accelerator.autocast():
            self._prompt_tokens = len(group.prompt_ids)  # what an allocation failure names
            state = self.engine.capture(causal_lm, group.prompt_ids, group.first_position)
            if not state.all_finite():  # checked as each chunk was written; one device sync here
                source = self._finiteness.first_non_finite() or state.first_non_finite_layer()  # fp8 overflow
                self._warn_non_finite("the captured prompt state", source)
        self._telemetry.record_state(state.nbytes(), self._mode())
        return state

    def _policy_state(self, causal_lm, group: PromptGroup):
        """The kept state if it is this prompt's and the weights have not moved since; otherwise a new capture.

        The kept state is released before capturing, so at most one state is alive besides the caller's.
        """
        state = self._kept.get(group, weights_version(causal_lm))
        return state if state is not None else self._capture(causal_lm, group, "capture")

    def _score_groups(self, causal_lm, groups, completion_ids, reference: bool, router_load: bool):
        """No-grad log-probs and entropies `[batch, completion_len]` of every row (`LongStrawEngine.score_group`), one
        prompt state at a time, the order used, and with `router_load` the rows' [`RouterLoad`].

        For the policy, the group whose state is kept goes first (no capture) and the last group's state stays kept.
        """
        kept = self._kept.group
        if not reference and kept is not None:
            groups = sorted(groups, key=lambda g: not kept.same_prompt(g.prompt_ids, g.first_position))
        logps = entropies = load = None
        for group in groups:
            if reference:
                self._kept.invalidate()
                state = self._capture(causal_lm, group, "capture_ref")
            else:
                state = self._policy_state(causal_lm, group)
            rows = torch.tensor(group.rows, device=completion_ids.device)
            with self._phase("score"), torch.no_grad(), self.accelerator.autocast():
                scores = self.engine.score_group(causal_lm, state, group, completion_ids[rows], router_load)
                scored = "the reference model's scored log-probs" if reference else "the scored log-probs"
                self._check_members(torch.isfinite(scores.logps).all(dim=1), scored, group)
            if router_load:
                load = scores.router_load if load is None else load + scores.router_load
            if logps is None:
                logps = scores.logps.new_zeros(completion_ids.shape)
                entropies = scores.logps.new_zeros(completion_ids.shape)
            logps[rows.to(logps.device)] = scores.logps.to(logps.device)
            if scores.entropies is not None:  # None: every member of the group is empty (e.g. all truncated)
                entropies[rows.to(entropies.device)] = scores.entropies.to(entropies)
            if not reference:
                self._kept.keep(group, state)
            del state
        if reference:
            self._kept.invalidate()
        return logps, entropies, groups, load

    # ---------------------------------------------------------------------------------------------------------------
    # The seam: GRPOTrainer asks for per-token log-probs (and, under grad, for their gradient)
    # ---------------------------------------------------------------------------------------------------------------
    @profiling_decorator
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
        """Log-probs (and entropies) of the completion tokens, from one capture per distinct prompt.

        Under no grad (old/reference scoring, evaluation) these are plain tensors. Under grad (TRL's `_compute_loss`
        inside `compute_loss`) they are the outputs of a [`~trl_longstraw.loss.ReplayedScores`] node: back-propagating
        any loss built on them replays each completion under autograd (`replay_backward`). A full forward of
        `prompt + completion` under autograd never happens. With `compute_aux_loss`, the third value is the MoE
        load-balancing loss over the rows (under grad, a third output of the same node), else None.
        """
        if any(value is not None for value in multimodal_inputs.values()):
            raise ValueError("LongStrawGRPOTrainer supports text-only inputs; got multimodal tensors.")
        reference = self._is_reference_pass(model)
        if torch.is_grad_enabled() and reference:
            raise RuntimeError(
                "Got a grad-enabled call scoring the reference model (ref_model, or the policy with its adapter "
                "disabled). Reference log-probs carry no gradient: score them under torch.no_grad(), as GRPOTrainer "
                "does."
            )
        completion_ids = input_ids[:, -logits_to_keep:]
        groups = self._groups(
            input_ids[:, :-logits_to_keep], attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
        )
        causal_lm = self._causal_lm(model)
        routing = self.engine.routing if compute_aux_loss else None
        with self._sharded_phase():
            logps, entropies, order, load = self._score_groups(
                causal_lm, groups, completion_ids, reference, router_load=routing is not None
            )
        aux_loss = None if load is None else load.loss(routing)
        if torch.is_grad_enabled():

            def replay(grad_logps, grad_entropies, grad_aux_loss):
                router_weights = None if grad_aux_loss is None else load.weights(routing, grad_aux_loss)
                self.replay_backward(
                    causal_lm, order[::-1], completion_ids, grad_logps, grad_entropies, router_weights
                )

            logps, entropies, aux_loss = replayed_scores(replay, logps, entropies, aux_loss)
        return logps, entropies if compute_entropy else None, aux_loss

    # ---------------------------------------------------------------------------------------------------------------
    # The update
    # ---------------------------------------------------------------------------------------------------------------
    def replay_backward(
        self, causal_lm, groups, completion_ids, grad_logps, grad_entropies, router_weights=None
    ) -> None:
        """Replay each member under autograd and back-propagate `d loss / d logp` (and `d loss / d entropy`, and
        with `router_weights` the load-balancing loss's gradient through the routing of its tokens): each group's
        share is `LongStrawEngine.update_group` (exact mode's prompt backward included).

        Groups are replayed in the order given (the last scored first: its state is still alive). A group whose
        gradient is zero (equal rewards and `beta = 0`, or every member masked, and no load-balancing loss) is not
        replayed, but the optimizer still gets what stock gives it: every parameter the update reaches ends with a
        gradient, zeros if nothing reached it this step (AdamW skips a parameter whose `.grad` is None: no step
        count, no weight decay). Under reentrant activation checkpointing the router logits carry no graph (in stock
        too, whose loss then gets none of this gradient): as in stock, the load-balancing loss then adds nothing.
        """
        exact = self.args.prompt_gradient == "exact"
        replayed = False
        for name, grad in (("log-probs", grad_logps), ("entropies", grad_entropies)):
            if grad is not None and not bool(torch.isfinite(grad).all()):
                self._warn_non_finite(f"the GRPO loss's gradient with respect to the scored {name}")
        with profiling_context(self, "replay_backward"):
            for group in groups:
                rows = torch.tensor(group.rows, device=completion_ids.device)
                group_grad = None if grad_logps is None else grad_logps[rows.to(grad_logps.device)]
                group_grad_entropies = (
                    None if grad_entropies is None else grad_entropies[rows.to(grad_entropies.device)]
                )
                if (
                    (group_grad is None or not group_grad.any())
                    and (group_grad_entropies is None or not group_grad_entropies.any())
                    and router_weights is None
                ):
                    continue
                if group_grad is None:
                    group_grad = torch.zeros(len(group.rows), completion_ids.shape[1], device=completion_ids.device)
                state = self._policy_state(causal_lm, group)
                # under context parallelism each rank replays its own members, the group's ranks in step
                replayed_here = self.engine.update_group(
                    causal_lm,
                    state,
                    group,
                    completion_ids[rows],
                    group_grad,
                    group_grad_entropies,
                    router_weights,
                    autocast=self.accelerator.autocast,
                    phase=self._phase,
                    check_replayed=lambda replayed, group=group: self._check_members(
                        replayed.finite, "the replayed log-probs", group, replayed.members
                    ),
                )
                replayed = replayed or bool(replayed_here.members)
                if not exact:  # exact mode's state has gradient buffers: single-use
                    self._kept.keep(group, state)
                del state
            if self._sharded is not None:  # FSDP2 reduces the gradients, once per window (fsdp.py)
                self._sharded.finish_phase()
                if self.accelerator.sync_gradients:
                    self._sharded.reduce_gradients()
                    self._check_gradients()
                return
            self._give_every_reached_parameter_a_gradient(causal_lm, groups, completion_ids, replayed)
            if self.accelerator.sync_gradients:  # over every rank (under CP too: `ParallelLayout`)
                average_gradients(self._reached, shares=self.parallel_layout.context_parallel)
                self._check_gradients()  # reduced, before the Trainer's clipping spreads a NaN to every gradient

    def _give_every_reached_parameter_a_gradient(self, causal_lm, groups, completion_ids, replayed: bool) -> None:
        """Zero `.grad` for every parameter a backward reaches and that none reached this time, as stock's would be.

        Which parameters a backward reaches is a property of the model (e.g. DSA indexers run under no_grad and get
        none, in stock too), which routing can widen (an expert a token reaches for the first time): the set is the
        union of every backward so far, over every rank, so that each rank averages the same parameters in the same
        order. If the first backward replays nothing, one member is replayed with a zero gradient to learn it.
        """
        if self._reached is None and not replayed:
            group = groups[0]
            state = self._policy_state(causal_lm, group)
            with self.accelerator.autocast():
                logps, _ = self.engine.replay(
                    causal_lm, state, group.prompt_ids[-1:], completion_ids[group.rows[0]], 1
                )
            member_backward(logps, None, torch.zeros_like(logps), None)
            self._kept.keep(group, state)
            del state
        known = {id(param) for param in self._reached or ()}
        trainable = [p for p in causal_lm.parameters() if p.requires_grad]
        reached = torch.tensor(
            [p.grad is not None or id(p) in known for p in trainable],
            dtype=torch.int32,
            device=self.accelerator.device,
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            with collective("agreement on the parameters reached"):
                torch.distributed.all_reduce(reached, op=torch.distributed.ReduceOp.MAX)
        self._reached = [p for p, hit in zip(trainable, reached.tolist(), strict=True) if hit]
        for param in self._reached:
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def replay_and_backward(self, model, inputs: dict[str, torch.Tensor | Any]) -> torch.Tensor:
        """`compute_loss(model, inputs).backward()`, returning the detached loss: the update of one micro-batch.

        `Trainer.training_step` does the same (through `accelerator.backward`); this is the explicit entry point for
        benchmarks and tests. With `prompt_gradient="exact"` the accumulated `.grad` equals stock `GRPOTrainer`'s;
        with "detach", that of the same loss with the prompt state held constant.
        """
        loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach()

    # ---------------------------------------------------------------------------------------------------------------
    # Cheap checks before generation, telemetry per mode
    # ---------------------------------------------------------------------------------------------------------------
    def _tokenize_prompts(self, prompts: list):
        """GRPOTrainer's tokenization, then the position (and context-parallel length) checks, before any completion
        is generated."""
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        check_positions(self.model.config, self.args, prompt_width=max(len(ids) for ids in prompt_ids))
        if self.parallel_layout.cp_group is not None:  # a prompt shorter than the CP group cannot be sharded
            check_prompt_length(min(len(ids) for ids in prompt_ids), self.parallel_layout.context_parallel)
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """One turn of generation (`_generate_turn`). Under FSDP2 the ranks finish the generation here without tools,
        after the tool loop (`_tool_call_loop`) with them."""
        with self._sharded_phase(finish=not self.tools):
            return self._generate_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )

    def _generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """GRPOTrainer's generation, from one capture per distinct prompt (`rollout_from_prompt_state`).

        The batch is what `generate` would get (left-padded to `pad_to_multiple_of`); see `trl_longstraw.rollout`. The
        state of an unpadded prompt stays kept: on policy, scoring and the update of its rows read it without a new
        capture. With tools, the first turn's states stay alive through GRPOTrainer's tool loop, whose turns (a row's
        prompt, then its completion and tool results so far) decode from their prompt's state with the rest of the
        row as a continuation: no turn captures the prompt again. (A `rollout_func` generates the first turn itself:
        its first tool turn captures each history, and later turns continue from those.)
        """
        if not self.rollout_from_prompt_state or not self._rollout_reproduces_generate():
            # TRL's generation, with the model's own attention
            with stock_attention(self._causal_lm(self.model)):
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
                )
        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        padded = pad(
            prompts,
            padding_value=self._tokenizer.pad_token_id,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        mask = pad(
            [torch.ones_like(ids) for ids in prompts],
            padding_value=0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).to(device)
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for row, ids in enumerate(prompt_ids):
            rows_of.setdefault(tuple(ids), []).append(row)
        tool_turn = self._tool_turns.in_tool_loop
        if not tool_turn:
            self._kept.invalidate()
        if self.parallel_layout.cp_group is not None and self.tools:  # tool results are computed by each rank itself
            check_same_rows(prompt_ids, self.parallel_layout.cp_group)
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
        ):
            causal_lm = self._causal_lm(unwrapped_model)
            sampling = prepare_sampling(causal_lm, self.generation_config, padded, mask)

            def capture(index, rows, prompt_ids):
                group = PromptGroup(index, rows, prompt_ids, first_position=0, completion_lengths=[])
                return self._capture(causal_lm, group, "capture")

            def extend(state, token_ids):
                return self.engine.extend(causal_lm, state, token_ids)

            prompt_rows = self._tool_turns.prompt_rows(
                rows_of,
                capture,
                extend,
                device,
                self.engine.shared_span_tokens,
                self.engine.distribution.continuation_tokens,
            )
            with self._phase("rollout"), self.accelerator.autocast():
                completion_ids = decode(self.engine, causal_lm, prompt_rows, padded, sampling)
            if not tool_turn:
                self._keep_first_turn(dict(zip(rows_of, prompt_rows, strict=True)), padded.shape[1])
            del prompt_rows
        # Everything after a row's first EOS goes, as in GRPOTrainer's transformers path.
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=completion_ids.device))
        first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), is_eos.shape[1])
        keep = torch.arange(is_eos.shape[1], device=is_eos.device)[None, :] <= first_eos[:, None]
        completion_ids = [c[m].tolist() for c, m in zip(completion_ids.cpu(), keep.cpu(), strict=True)]
        return completion_ids, None

    def _keep_first_turn(self, prompt_rows: dict[tuple[int, ...], PromptRows], padded_width: int) -> None:
        """After a generation's first turn: keep the state scoring can reuse, and with tools every prompt's state
        for the tool loop's turns.

        Scoring numbers positions as stock's padded forward does: only an unpadded prompt's state (the batch's widest,
        without pad_to_multiple_of padding) can serve it; keep that one, or none."""
        reusable = [entry for entry in prompt_rows.values() if len(entry.prompt_ids) == padded_width]
        if reusable:
            rows, prompt_ids = reusable[-1].rows, reusable[-1].prompt_ids
            group = PromptGroup(0, rows, prompt_ids, first_position=0, completion_lengths=[])
            self._kept.keep(group, reusable[-1].state)
        if self.tools:
            self._tool_turns.keep(prompt_rows)

    def _generate(self, prompts: list):
        """GRPOTrainer's generation (first turn, then the tool loop); the prompt states kept for its tool turns are
        released when it ends, before scoring."""
        try:
            return super()._generate(prompts)
        finally:
            self._tool_turns.release()

    def _tool_call_loop(self, *args, **kwargs):
        """GRPOTrainer's tool loop; under FSDP2 the ranks finish the generation after it, as each may take a different
        number of turns."""
        with self._sharded_phase():
            return super()._tool_call_loop(*args, **kwargs)

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler; under context parallelism one set of rows per CP group (`SharedRowsSampler`)."""
        sampler = super()._get_train_sampler(dataset)
        if self.parallel_layout.cp_group is None:
            return sampler
        rows_per_rank = self._train_batch_size * self.args.steps_per_generation  # one rank's dataloader batch
        return SharedRowsSampler(sampler, rows_per_rank, self.parallel_layout.context_parallel)

    def get_eval_dataloader(self, eval_dataset=None):
        """TRL's; under context parallelism the eval set is checked first (`validation.check_eval_dataset`)."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if self.parallel_layout.cp_group is not None and dataset is not None:  # none at all: TRL's own error
            check_eval_dataset(
                self.eval_dataset[dataset] if isinstance(dataset, str) else dataset,
                self.parallel_layout.context_parallel,
                self.args,
                self.num_generations_eval,
            )
        return super().get_eval_dataloader(eval_dataset)

    def _get_eval_sampler(self, eval_dataset):
        """TRL's sampler; under context parallelism one set of rows per CP group, as in training."""
        sampler = super()._get_eval_sampler(eval_dataset)
        if self.parallel_layout.cp_group is None:
            return sampler
        return SharedRowsSampler(sampler, self.args.per_device_eval_batch_size, self.parallel_layout.context_parallel)

    def _generate_and_score_completions(self, inputs):
        self._kept.invalidate()  # generation needs the memory, and the weights may have moved since
        if self.parallel_layout.cp_group is not None:  # a CP group shares its prompts, so it must share its rows
            inputs = share_leader_inputs(inputs, self.parallel_layout.cp_group)
        return super()._generate_and_score_completions(inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """GRPOTrainer's rewards of every rank; under context parallelism the copies of a CP group must agree
        (`check_same_rewards`)."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.parallel_layout.cp_group is not None:
            check_same_rewards(rewards, self.parallel_layout.cp_group, len(prompts))
        return rewards

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """GRPOTrainer's mask of the tokens at or above the entropy quantile `threshold` over every rank's tokens,
        each row counted once: under context parallelism a CP group's ranks hold the same rows, and a quantile over
        every copy would move its interpolation point, so only a CP group's first rank contributes its tokens."""
        # GRPOTrainer's own tests call this on a bare `Mock(spec=GRPOTrainer)`, which has no `parallel_layout`.
        cp_group = getattr(getattr(self, "parallel_layout", None), "cp_group", None)
        if cp_group is None:
            return super().get_high_entropy_mask(entropies, mask, threshold)
        local = leader_rows(entropies[mask.bool()].float(), cp_group)
        pad_value = -1e9  # entropies are never negative: a sentinel for the padding across processes, as in TRL
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad_value))
        gathered = gathered[gathered != pad_value]
        if gathered.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        return (entropies * mask.float() >= torch.quantile(gathered, threshold)) & mask.bool()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._mode() == "eval":  # one evaluation's phases, logged with it (train flushes per optimizer step)
            self._flush_telemetry("eval")
        super().log(logs, start_time)
