"""Weights sharded with FSDP2 (`fully_shard`): the LongStraw update on ranks that hold parameter shards.

FSDP2 gathers each sharded module's parameters inside its forward and backward, collectively: every rank of the mesh
must run the same sequence of forwards and backwards. LongStraw's update is data-dependent on each rank (a prompt's
capture chunks, the rollout's steps, the members and groups replayed, a state kept from the previous micro-step), so
the ranks agree pass by pass: before each forward of the sharded causal LM, the ranks exchange the kind of pass each is
about to run (a forward, or a forward whose backward follows) and run the kind the fewest are waiting on; a rank whose
next pass is of another kind, or that has finished its phase, runs a two-token pass of that kind instead (no prompt
state, zero gradient). At the end of each phase every rank answers until all have finished (`finish_phase`).

Freeing: FSDP2 frees a module's gathered weights after its forward, except for a forward run inside a backward (it
takes that for activation checkpointing's recompute, whose backward follows at once). LongStraw's replays run inside
the loss's backward (the `ReplayedScores` node), so every sharded module under the root also frees its weights after
each forward of a pass of the root; activation checkpointing's recomputes, which run a layer alone, keep FSDP2's rule.

Gradients: FSDP2 reduce-scatters in a backward whose gradient sync is on. LongStraw keeps it off for every backward of
the accumulation window (one per replayed member, one per exact-mode prompt chunk) and closes the window with one
synced pass on every rank (`reduce_gradients`), so gradients are reduce-scattered once per optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from .faults import collective

FORWARD, BACKWARD, FINISHED = 0, 1, 2


def is_sharded(model: nn.Module) -> bool:
    """Whether any of `model`'s parameters is a DTensor (sharded by FSDP2, or split by tensor parallelism)."""
    return any(isinstance(param, DTensor) for param in model.parameters())


def shard_count(model: nn.Module) -> int:
    """The ranks each of `model`'s DTensor parameters is split over (the first one's mesh: its last dimension, which
    is FSDP2's shard dimension on a 2D hybrid-sharding mesh), 1 if it has none."""
    return next((param.device_mesh.size(-1) for param in model.parameters() if isinstance(param, DTensor)), 1)


def check_sharded_layout(causal_lm: nn.Module) -> None:
    """The layout LongStraw drives under FSDP2: the causal LM itself is the root `fully_shard` module (its hooks gather
    the embeddings, final norm and head around every forward LongStraw runs), and every trainable parameter is sharded
    (FSDP2 then reduces every gradient; a replicated adapter would be averaged by nobody)."""
    fix = (
        "Shard the decoder layers, then the causal LM itself: `for layer in model.model.layers: fully_shard(layer)`, "
        "then `fully_shard(model)`; with PEFT, call `get_peft_model` first and shard `peft_model.get_base_model()` "
        "the same way."
    )
    if not isinstance(causal_lm, FSDPModule):
        raise TypeError(
            f"The model has DTensor parameters but its causal LM ({type(causal_lm).__name__}) is not a `fully_shard` "
            f"root. {fix}"
        )
    trainable = causal_lm.named_parameters()
    replicated = [name for name, param in trainable if param.requires_grad and not isinstance(param, DTensor)]
    if replicated:
        raise ValueError(
            f"Trainable parameters {replicated[:3]} (and {max(len(replicated) - 3, 0)} more) are not sharded: they were "
            f"added after `fully_shard`. {fix}"
        )


def check_weights_loaded(model: nn.Module) -> None:
    """Before the trainer shards (or moves) a model: every parameter holds its weights on this rank."""
    on_meta = [name for name, param in model.named_parameters() if param.is_meta]
    if on_meta:
        raise ValueError(
            f"shard_weights=True: {on_meta[0]} (and {len(on_meta) - 1} more) hold no weights on this rank (the meta "
            "device): the model was loaded while an FSDP accelerate config's cpu_ram_efficient_loading was in effect, "
            "which loads the weights on the first rank only. Create the LongStrawGRPOConfig before loading the model "
            "(it turns that loading off), or pass the model id to the trainer."
        )


def fully_shard_model(causal_lm: nn.Module, layer_classes: list[str] | None = None) -> None:
    """FSDP2 as Accelerate's `fsdp_version: 2` wraps a transformers model: every module whose class is one of
    `layer_classes` (default: those the model lists in `_no_split_modules`, its decoder layers; innermost first), then
    the causal LM as the root, over every rank."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "shard_weights=True needs the ranks' process group: launch with `accelerate launch --multi_gpu "
            "--num_processes N` or `torchrun --nproc_per_node N`."
        )
    if getattr(causal_lm, "is_loaded_in_8bit", False):
        raise ValueError(
            "shard_weights=True with a model loaded in 8 bits (bitsandbytes LLM.int8): not verified under FSDP2. Load "
            "it in 4 bits (QLoRA: load_in_4bit=True) or in bf16."
        )
    wanted = set(layer_classes or getattr(causal_lm, "_no_split_modules", None) or ())
    layers = [module for module in causal_lm.modules() if type(module).__name__ in wanted]
    if not layers:
        named = f"has no module of the classes {sorted(wanted)}" if layer_classes else "lists no decoder-layer classes"
        raise ValueError(
            f"shard_weights=True: {type(causal_lm).__name__} {named} (`shard_layer_classes`, else `_no_split_modules`) "
            "to shard one by one. Name its decoder-layer class in shard_layer_classes (an accelerate config's "
            "fsdp_transformer_layer_cls_to_wrap), or shard the model with `fully_shard` yourself before handing it to "
            "the trainer."
        )
    for layer in reversed(layers):  # an inner listed module before the layer holding it
        fully_shard(layer)
    fully_shard(causal_lm)


def keep_4bit_layout(causal_lm: nn.Module) -> None:
    """bitsandbytes' 4-bit layers under FSDP2. The packed weight is an ordinary tensor that FSDP2 shards and gathers;
    each layer keeps its quantisation state (absmax) whole, and rebuilds its 4-bit weight from the gathered tensor and
    that state in every forward. On a CPU with AVX512-BF16, a forward in eval mode without autograd repacks the weight
    into a CPU layout and rewrites the shared state to match: FSDP2 drops the repacked tensor (the next gather brings
    back the original layout) but the rewritten state stays, so every later forward dequantises wrongly, without an
    error. The repacking is turned off on the model's 4-bit layers (`support_avx512bf16_for_cpu`) before FSDP2 shards
    them; a layer repacked already is refused (FSDP2 would shard the CPU layout, which the layer cannot rebuild)."""
    from bitsandbytes.nn import Linear4bit

    for name, module in causal_lm.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            raise ValueError(
                f"{name}: bitsandbytes repacked this 4-bit weight into its CPU layout (a forward in eval mode without "
                "autograd, e.g. generate() or evaluation, ran before the weights were sharded), which FSDP2 cannot "
                "gather. Hand the model to the trainer (shard_weights=True), or shard it with fully_shard, before "
                "running it; or load it again."
            )
        module.support_avx512bf16_for_cpu = False


def sharded_mesh_group(causal_lm: nn.Module) -> dist.ProcessGroup:
    """The process group of the ranks whose passes are kept in step: the whole world, which the parameters' mesh
    must span (1D: the shards over every rank; 2D hybrid sharding: replicas x shards, e.g. FSDP2 inside each
    context-parallel group, replicated across the groups). A mesh over a subset of the ranks is refused."""
    mesh = next(param.device_mesh for param in causal_lm.parameters() if isinstance(param, DTensor))
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"The parameters' device mesh spans {mesh.size()} of the {dist.get_world_size()} ranks. "
            "LongStrawGRPOTrainer keeps every rank in step: build the mesh over all of them "
            "(`init_device_mesh(device_type, (world_size,))`, fully_shard's default, or a 2D "
            "`(replicas, shards)` mesh for hybrid sharding)."
        )
    return dist.group.WORLD


class ShardedPasses:
    """Keeps the ranks holding one FSDP2 model's shards in step, pass by pass (module docstring).

    Args:
        root: the causal LM, the root `fully_shard` module.
        device: where the ranks' agreement tensor lives (the model's device: gloo on CPU, NCCL on GPU).
        group: the ranks that share the shards.
        context_parallel_size: ranks per context-parallel group. Each holds its share of its group's gradient, so the
            reduce-scatter's mean over every rank is multiplied by it: the sum of the shares, averaged over the
            data-parallel ranks (FSDP2's own divide factor would take a PREMUL_SUM, which gloo lacks).
    """

    def __init__(
        self,
        root: nn.Module,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        context_parallel_size: int = 1,
    ):
        self.root = root
        self.device = device
        self.group = group
        self.rounds = 0  # agreements made (one per pass of any rank); read by tests and benchmarks
        self.stand_ins = 0  # passes run only to keep step with another rank
        self.synced_passes = 0  # gradient reductions (`reduce_gradients`)
        self._standing_in = False
        self._in_pass = False  # the root's forward is running
        self._tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
        root.set_requires_gradient_sync(False)
        # prepended: the agreement precedes FSDP2's own pre-forward (its parameter all-gather)
        self._hooks = [
            root.register_forward_pre_hook(self._before_forward, prepend=True),
            root.register_forward_hook(self._after_forward, always_call=True),
        ]
        for module in root.modules():
            if module is not root and isinstance(module, FSDPModule):
                self._hooks.append(module.register_forward_hook(self._free_after_forward))
        self.context_parallel_size = context_parallel_size

    def _before_forward(self, module: nn.Module, args) -> None:
        if not self._standing_in:
            self._agree(BACKWARD if torch.is_grad_enabled() else FORWARD)
        self._in_pass = True

    def _after_forward(self, module: nn.Module, args, output) -> None:
        self._in_pass = False

    def _free_after_forward(self, module: nn.Module, args, output) -> None:
        """A sharded module's weights freed after its forward in a pass (module docstring): a no-op where FSDP2 has
        freed them already; a backward gathers them again when it reaches the module's outputs."""
        if self._in_pass:
            module.reshard()

    def _agree(self, kind: int) -> None:
        """Return when every rank's next pass is `kind` (or, for FINISHED, when every rank has finished), standing in
        for the kind the other ranks run until then."""
        while True:
            chosen = torch.tensor([kind], device=self.device)
            with collective("agreement on the next pass", self.group):
                dist.all_reduce(chosen, op=dist.ReduceOp.MIN, group=self.group)
            self.rounds += 1
            chosen = int(chosen.item())
            if chosen == kind:
                return
            self.stand_ins += 1
            self._zero_pass(chosen)

    def _zero_pass(self, kind: int) -> None:
        """A two-token pass of `kind` through the whole model, without prompt state: the same gathers (and, for
        BACKWARD, the same backward) as any pass, adding zero to every gradient."""
        self._standing_in = True
        try:
            with torch.set_grad_enabled(kind == BACKWARD):
                logits = self.root(input_ids=self._tokens, use_cache=False, logits_to_keep=1).logits
                if kind == BACKWARD and logits.requires_grad:  # (nothing trainable: no pass has a backward)
                    (logits.sum() * 0).backward()
        finally:
            self._standing_in = False

    def finish_phase(self) -> None:
        """Answer the other ranks' passes until every rank has finished this phase. Every rank calls it at the same
        point of the update, before any other collective."""
        self._agree(FINISHED)

    def reduce_gradients(self) -> None:
        """Close the accumulation window: one pass with gradient sync on, on every rank at once, after which FSDP2
        has reduce-scattered every module's accumulated gradient into its sharded `.grad`."""
        self.finish_phase()
        self.root.set_requires_gradient_sync(True)
        try:
            self._zero_pass(BACKWARD)
        finally:
            self.root.set_requires_gradient_sync(False)
        if self.context_parallel_size > 1:
            for param in self.root.parameters():
                if param.grad is not None:
                    param.grad.mul_(self.context_parallel_size)
        self.synced_passes += 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
