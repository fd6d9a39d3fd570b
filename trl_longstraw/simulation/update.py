"""One LongStraw update, run in the simulation's own process: the model built at full width on the simulated device,
parallelised and trained as the trainer would, every phase tracked.

What runs is the library's own update code, in the trainer's order for one micro-step holding one whole group
(`per_device_train_batch_size = num_generations`, the recipes' layout): the rollout's capture and `decode_steps`
decoding steps (optional), the reference model's capture and scores (`beta != 0`), the old policy's scores
(`num_iterations > 1`), the policy's scores that TRL's loss reads (`LongStrawEngine.score_group`), the serial replays
with their backward and exact mode's prompt backward (`LongStrawEngine.update_group`, as the trainer calls them), the
gradients' reduction across ranks (FSDP2's reduce-scatter, or the data-parallel all-reduce) and the optimizer step.
TRL's own loss arithmetic on the group's `[G, R]` scores is the one thing not run: its tensors are the scores and their
gradient, allocated here as its backward would hand them over.

Every setting the planner takes is honoured as the trainer honours it: the model's dtype and autocast, NF4 weights
(bitsandbytes' `Linear4bit`, quantised on the device), LoRA by PEFT (adapters in bf16 on a quantised model, as TRL casts
them), activation checkpointing, fp8 prompt-state pages and host-resident state, the chunk sizes, context parallelism
(the engine's `ContextParallel` distribution on its CP group) and FSDP2 (`fully_shard_model`, kept in step by `ShardedPasses`). AdamW's
state exists before the update, as a previous step left it (one warm-up step of zero gradients, in the phase
`optimizer_state`). In a world of several ranks the process plays one rank; the others are the simulated world's
(`world.py`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .devices import device_spec
from .tracker import Oversize, UpdateTracker

SETUP = ("weights", "optimizer_state")  # what the update starts from: not its phases
PHASES = (
    "weights",
    "optimizer_state",
    "capture",
    "rollout",
    "capture_ref",
    "score",
    "replay",
    "prompt_backward",
    "gradient_sync",
    "optimizer",
)


@dataclass
class SimulationSpec:
    """What one simulated update runs (JSON across the process boundary)."""

    config: dict  # the model's config (`PretrainedConfig.to_dict()`)
    setup: dict  # `UpdateSetup`'s fields
    model: str = ""
    prompt_gradient: str = "detach"
    context_parallel: int = 1
    weight_shards: int = 1
    world_size: int = 1
    rank: int = 0
    device_spec: str = "H200"
    decode_steps: int = 0
    reference: bool = False  # beta != 0: the reference's capture and scores
    old_scores: bool = False  # num_iterations > 1: the old policy's scores
    device: str = "cuda"  # "cpu": a simulation of the host path (the validation's)
    fake: bool = True  # False: real tensors (the validation's tracked real run)
    seed: int = 0
    progress: bool = False
    sample: int = 2  # iterations run of each run of interchangeable ones (`block_attention.visits`); 0: every one


@dataclass
class Progress:
    """A bar per phase on stderr, advanced by every forward of the model (a capture chunk, a member, a step)."""

    enabled: bool
    bar: object = None
    counts: Counter = field(default_factory=Counter)

    def start(self, phase: str, total: int | None) -> None:
        self.close()
        if self.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=f"simulating {phase:<16}", unit="pass", file=sys.stderr, leave=True)

    def forward(self, *_) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _config(spec: SimulationSpec):
    from transformers import CONFIG_MAPPING

    values = dict(spec.config)
    return CONFIG_MAPPING[values.pop("model_type")].from_dict(values)


def _dtype(setup) -> torch.dtype:
    return torch.float32 if setup.dtype_bytes == 4 else torch.bfloat16


def build_model(
    config, setup, device: torch.device, fake: bool, seed: int, oversize: Oversize | None = None
) -> tuple[nn.Module, nn.Module]:
    """`(model, causal LM)`: the model as the trainer holds it (a PEFT model around the causal LM with LoRA), its
    weights on `device`. Fake: the whole structure (NF4 layers, adapters) built on the meta device outside every mode,
    then given fake storage on `device`; real: built with random weights from `seed`."""
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers import AutoModelForCausalLM

    dtype = _dtype(setup)
    if fake:
        with _disable_current_modes(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            linears = _quantizable(model) if setup.quantization == "nf4" else {}
            if linears:
                _replace_with_nf4(model, setup)
                import bitsandbytes as bnb

                for module in model.modules():  # quantised one by one below, not materialised whole first
                    if isinstance(module, bnb.nn.Linear4bit):
                        module.weight = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
            if setup.lora_rank:
                model = _add_lora(model, setup)
            if oversize is not None:
                oversize.exempt(model)
        model.to_empty(device=device)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        linears = _quantizable(model) if setup.quantization == "nf4" else {}
        if linears:
            _replace_with_nf4(model, setup)
        if setup.lora_rank:
            model = _add_lora(model, setup)
        if oversize is not None:
            oversize.exempt(model)
        model.to(device)
    if linears:
        _quantize_nf4(model, linears, setup, device, fake)
    if setup.quantization == "nf4" and setup.lora_rank:  # TRL casts QLoRA adapters to bf16
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model, causal_lm


def _quantizable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The linear maps transformers' bitsandbytes integration converts, by name, with their full-width weights."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return {
        name: module.weight
        for name, module in model.named_modules()
        if type(module) is nn.Linear and should_convert_module(name, skip)
    }


def _replace_with_nf4(model: nn.Module, setup) -> None:
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=setup.double_quant,
        bnb_4bit_compute_dtype=_dtype(setup),
    )
    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=quantization)


def _quantize_nf4(model: nn.Module, linears: dict[str, torch.Tensor], setup, device: torch.device, fake: bool) -> None:
    """Each `Linear4bit`'s weight quantised on the device by bitsandbytes (`quantize_4bit`), as `from_pretrained`
    quantises it while loading. The packed codes are a plain parameter carrying its quantisation state (as
    `Params4bit` carries it: a fake tensor cannot become one), and the layer keeps the state too, as bitsandbytes
    does for a weight FSDP2 re-registers."""
    import bitsandbytes as bnb

    modules = {name.removeprefix("base_model.model."): module for name, module in model.named_modules()}
    for name, weight in linears.items():
        module = modules[name]
        layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        full = torch.empty(weight.shape, dtype=weight.dtype, device=device) if fake else weight.data.to(device)
        packed, state = bnb.functional.quantize_4bit(
            full, blocksize=64, compress_statistics=setup.double_quant, quant_type="nf4", quant_storage=torch.uint8
        )
        del full
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.weight.quant_state = layer.quant_state = state


def _add_lora(model: nn.Module, setup) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = setup.lora_targets
    targets = list(targets) if isinstance(targets, (list, tuple)) else targets
    return get_peft_model(model, LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank, target_modules=targets))


def _optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as the Trainer builds it by default (`adamw_torch_fused`)."""
    params = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(params, lr=1e-5, fused=device.type in ("cuda", "cpu"))


def run(spec: SimulationSpec) -> dict:
    """One update under `spec`, tracked; its report (`SimulationReport.to_dict()`'s fields)."""
    from ..accounting import UpdateSetup
    from .runtime import SimulatedDevice
    from .stand_ins import install_model_stand_ins, install_trl_head_stand_ins
    from .world import World, simulated_world

    started = time.monotonic()
    setup = UpdateSetup(**{**spec.setup, "lora_targets": _targets(spec.setup["lora_targets"])})
    config = _config(spec)
    text = config.get_text_config()
    device = torch.device(spec.device, 0) if spec.device == "cuda" else torch.device(spec.device)
    devices = device_spec(spec.device_spec)
    # a chunk's tokens, each routed to up to `num_experts_per_tok` experts (a MoE layer's dispatch), is no prompt
    chunk = max(setup.prefill_chunk_size, setup.attention_chunk_size, setup.completion_tokens + 1)
    chunk *= getattr(text, "num_experts_per_tok", None) or 1
    tracker = UpdateTracker(
        device.type,
        devices,
        Oversize(long=2 * chunk, wide=text.hidden_size),
        settle_collectives=not spec.fake and spec.world_size > 1,
    )
    mode = SimulatedDevice() if spec.fake else contextlib.nullcontext()
    progress = Progress(spec.progress)
    stand_ins: list[str] = []
    with contextlib.ExitStack() as stack:
        if spec.fake:
            world = stack.enter_context(simulated_world(spec, devices))
            mode.collectives = world.collectives
        else:  # real tensors: the launch's own process group (gloo), if any
            world = World(spec.rank, spec.world_size)
        stack.enter_context(mode)
        stack.enter_context(tracker)
        with tracker.phase("weights"):
            model, causal_lm = build_model(config, setup, device, spec.fake, spec.seed, tracker.oversize)
            if spec.fake and device.type == "cuda":
                stand_ins = install_model_stand_ins(causal_lm) + install_trl_head_stand_ins()
            update = GroupUpdate(spec, setup, model, causal_lm, device, tracker, progress)
        with tracker.phase("optimizer_state"):
            update.warm_optimizer()
        stack.enter_context(update.sampling())
        update.run()
        progress.close()
        tracker.oversize.exempt(model)  # its shards' shapes too, now that they exist
    reads = dict(mode.answered_reads) if spec.fake else {}
    largest = tracker.largest(name for name in tracker.phases if name not in SETUP)
    return {
        "model": spec.model,
        "rank": spec.rank,
        "world_size": spec.world_size,
        "device_spec": devices.name,
        "peak_gib": max(tracker.phases[name].peak_bytes for name in tracker.phases if name not in SETUP) / 2**30,
        "phases": {name: tracker.phases[name].to_dict() for name in PHASES if name in tracker.phases},
        "largest_allocation": None if largest is None else largest.to_dict(),
        "oversized": [
            made.to_dict() for made in tracker.oversized_of(name for name in tracker.phases if name not in SETUP)
        ],
        "stand_ins": stand_ins,
        "answered_reads": reads,
        "sampled_iterations": update.sampled,
        "world": world.describe(),
        "ops": tracker.ops,
        "wall_s": time.monotonic() - started,
    }


def _targets(targets):
    return tuple(targets) if isinstance(targets, list) else targets


class GroupUpdate:
    """The update of one whole group on one rank, phase by phase, through the library's engine (module docstring)."""

    def __init__(self, spec, setup, model, causal_lm, device, tracker: UpdateTracker, progress: Progress):
        from transformers import GenerationConfig
        from trl.trainer.utils import add_fused_lm_head

        from ..context_parallel import distribution_over
        from ..engine import LongStrawEngine, prepare_model
        from ..fsdp import ShardedPasses, parallelize
        from ..parallel_layout import ParallelLayout

        self.spec, self.setup, self.model, self.causal_lm = spec, setup, model, causal_lm
        self.device, self.tracker, self.progress = device, tracker, progress
        self.sampled = 0
        add_fused_lm_head(causal_lm, outputs=("log_probs", "entropy"))
        if setup.activation_checkpointing:
            if model is not causal_lm:
                model.enable_input_require_grads()
            causal_lm.activation_checkpointing_enable()
        adapter_units = parallelize(causal_lm, spec.weight_shards > 1, None)  # as the trainer shards (fsdp.py)
        prepare_model(causal_lm)
        causal_lm.register_forward_pre_hook(progress.forward)
        layout = ParallelLayout.build(spec.context_parallel, causal_lm)
        self.sharded = (
            None
            if adapter_units is None
            else ShardedPasses(causal_lm, device, layout.shard_group, layout.context_parallel, adapter_units)
        )
        self.engine = LongStrawEngine(
            prefill_chunk_size=setup.prefill_chunk_size,
            attention_chunk_size=setup.attention_chunk_size,
            state_device=torch.device("cpu") if setup.state_device == "cpu" else None,
            prompt_gradient=spec.prompt_gradient,
            prompt_state_dtype=setup.state_dtype,
            distribution=distribution_over(layout.cp_group),
            replay_segment_size=setup.replay_segment_size,
        )
        self.optimizer = _optimizer(model, device)
        self.generation = GenerationConfig(max_new_tokens=max(spec.decode_steps, 1), do_sample=True, temperature=1.0)
        self.dtype = _dtype(setup)

    def autocast(self):
        """The trainer's `accelerator.autocast()`: bf16 mixed precision for a bf16 run (the recipes' `bf16: true`)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def sampling(self):
        """Interchangeable loop iterations (`block_attention.visits`) sampled: the first `spec.sample` of each key run, the
        rest accounted by the last run one's cost."""
        from ..block_attention import sampled_visits

        if not self.spec.sample:
            return contextlib.nullcontext()
        return sampled_visits(self._visit)

    def _visit(self, items, key, together=None):
        memo = {} if together is None else together
        seen: Counter = memo.setdefault("seen", Counter())
        costs = memo.setdefault("costs", {})
        for item in items:
            item_key = key(item)
            seen[item_key] += 1
            if seen[item_key] > self.spec.sample and item_key in costs:
                self.tracker.repeat(costs[item_key])
                self.sampled += 1
                continue
            before = self.tracker.totals()
            yield item
            costs[item_key] = self.tracker.totals() - before

    def warm_optimizer(self) -> None:
        """AdamW's state as a previous step left it: one step of zero gradients, which are then dropped."""
        for param in self.optimizer.param_groups[0]["params"]:
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _phase(self, name: str, passes: int | None):
        self.progress.start(name, passes)
        return self.tracker.phase(name)

    def run(self) -> None:
        from ..groups import PromptGroup

        spec, setup, engine, lm = self.spec, self.setup, self.engine, self.causal_lm
        vocab = lm.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(spec.seed)
        prompt = torch.randint(vocab, (setup.prompt_tokens,), generator=generator).to(self.device)
        group = setup.group_size
        completions = torch.randint(vocab, (group, setup.completion_tokens), generator=generator).to(self.device)
        whole_group = PromptGroup(0, list(range(group)), prompt, 0, [setup.completion_tokens] * group)
        chunks = -(-(setup.prompt_tokens - 1) // setup.prefill_chunk_size)
        segments = len(engine.member_segments(setup.completion_tokens))  # forwards per member scored
        replays = 2 * segments - 1  # a segmented replay captures all but its last segment first
        if spec.context_parallel > 1 and engine.distribution.in_steps(engine, setup.completion_tokens):
            members = group  # each by the whole CP group, a chunk of each segment per rank, all captured first
            segments = -(-segments // spec.context_parallel)
            replays = 2 * segments
        else:
            members = len(engine.distribution.members(list(range(group))))
        replays *= members
        passes = {"replay": replays, "prompt_backward": -(-chunks // spec.context_parallel)}
        state = None
        if spec.decode_steps:
            with self._phase("capture", chunks), torch.no_grad(), self.autocast():
                state = engine.capture(lm, prompt, 0)
            with self._phase("rollout", spec.decode_steps), torch.no_grad(), self.autocast():
                self._decode(state, prompt, group)
            self._finish_phase()
        if spec.reference:
            state = None  # the trainer releases the policy's state before the reference's capture
            with self.model.disable_adapter() if self.model is not lm else contextlib.nullcontext():
                with self._phase("capture_ref", chunks), torch.no_grad(), self.autocast():
                    reference = engine.capture(lm, prompt, 0)
                with self._phase("score", members * segments), torch.no_grad(), self.autocast():
                    engine.score_group(lm, reference, whole_group, completions)
                del reference
            self._finish_phase()
        scorings = 2 if spec.old_scores else 1  # the old policy's scores, then the loss's
        for _ in range(scorings):
            if state is None:
                with self._phase("capture", chunks), torch.no_grad(), self.autocast():
                    state = engine.capture(lm, prompt, 0)
            with self._phase("score", members * segments), torch.no_grad(), self.autocast():
                scores = engine.score_group(lm, state, whole_group, completions)
            self._finish_phase()
        logps = scores.logps
        grad_logps = torch.full_like(logps, 1.0 / logps.numel())  # TRL's loss's gradient, handed to the replay
        del scores
        engine.update_group(
            lm,
            state,
            whole_group,
            completions,
            grad_logps,
            autocast=self.autocast,
            phase=lambda name: self._phase(name, passes[name]),
        )
        if spec.prompt_gradient == "exact":
            state = None  # its gradient buffers make it single-use: the trainer drops it
        del logps, grad_logps
        with self._phase("gradient_sync", None):
            self._reduce_gradients()
        with self._phase("optimizer", None):  # a detach-mode state is kept through the step, as the trainer keeps it
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        del state

    def _finish_phase(self) -> None:
        if self.sharded is not None:  # the ranks' passes agree at a phase's end (fsdp.py)
            self.sharded.finish_phase()

    def _reduce_gradients(self) -> None:
        """The end of the accumulation window, as the trainer closes it: FSDP2's reduce-scatter, or the data-parallel
        all-reduce (under context parallelism too: every rank holds its share of its group's gradient), then the
        gradients' finiteness check."""
        from ..distributed import average_gradients
        from ..faults import first_non_finite_gradient

        if self.sharded is not None:
            self.sharded.finish_phase()
            self.sharded.reduce_gradients()
        else:
            params = [param for param in self.model.parameters() if param.requires_grad]
            average_gradients(params, shares=self.spec.context_parallel)
        first_non_finite_gradient(self.model)  # the trainer's check, on this rank's shards (empty ones too)

    def _decode(self, state, prompt: torch.Tensor, group: int) -> None:
        from ..rollout import PromptRows, decode, prepare_sampling

        self.causal_lm.generation_config.eos_token_id = None  # every row decodes `decode_steps` tokens
        rows = prompt[None].expand(group, -1)
        sampling = prepare_sampling(self.causal_lm, self.generation, rows, torch.ones_like(rows))
        decode(self.engine, self.causal_lm, [PromptRows(list(range(group)), prompt, state)], rows, sampling)


def main() -> None:
    """The child process's entry: a JSON list of `SimulationSpec`s on stdin, run one after another; their reports as
    one JSON list on stdout's last line."""
    specs = [SimulationSpec(**values) for values in json.loads(sys.stdin.read())]
    reports = [run(spec) for spec in specs]
    print(json.dumps(reports))
