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
A unit sharded with `reshard_after_forward=False` (transformers' load-time plan groups the final norm with the LM head
so) stays gathered from its forward to its backward, as FSDP2 keeps it. An adapter sharded after the model
(`shard_added_parameters`) is gathered and freed with the decoder layer holding it (`ShardedPasses`, `adapter_units`).

Gradients: FSDP2 reduce-scatters in a backward whose gradient sync is on. LongStraw keeps it off for every backward of
the accumulation window (one per replayed member, one per exact-mode prompt chunk) and closes the window with one
synced pass on every rank (`reduce_gradients`), so gradients are reduce-scattered once per optimizer step.
"""

from __future__ import annotations

import functools

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
    """The layout LongStraw drives under FSDP2: the causal LM itself is the root `fully_shard` module (its hooks, and
    those of any unit inside it, gather the embeddings, final norm and head around every forward LongStraw runs), and
    every trainable parameter is sharded (FSDP2 then reduces every gradient; a replicated one would be averaged by
    nobody)."""
    fix = (
        "Shard the decoder layers, then the causal LM itself: `for layer in model.model.layers: fully_shard(layer)`, "
        "then `fully_shard(model)`, or load it sharded: `from_pretrained(..., "
        "distributed_config=DistributedConfig(fsdp_size=world_size))`."
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
            f"added after `fully_shard` to modules that also hold sharded parameters. {fix}"
        )


def shard_added_parameters(causal_lm: nn.Module) -> list[nn.Module]:
    """Shard the trainable parameters added to a sharded model (PEFT's adapters, added by TRL after transformers
    loaded the model sharded, or after the user's `fully_shard`): each module holding such parameters alone (an
    adapter's `lora_A`/`lora_B` layer) becomes a `fully_shard` unit of its own over the model's mesh, before the
    root's first forward (FSDP2 then finds it among the root's units). The units added: a pass with the adapter
    disabled (the reference's) skips their forwards, so `ShardedPasses` gathers them with the unit holding them."""
    mesh = next(param.device_mesh for param in causal_lm.parameters() if isinstance(param, DTensor))
    added = [
        module
        for module in causal_lm.modules()
        if not isinstance(module, FSDPModule)
        and any(p.requires_grad for p in module.parameters(recurse=False))
        and not any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
    ]
    if added and isinstance(causal_lm, FSDPModule) and causal_lm._get_fsdp_state()._is_root is not None:
        raise ValueError(
            f"{type(added[0]).__name__} (and {len(added) - 1} more modules) hold trainable parameters added after the "
            "sharded model ran its first forward, when FSDP2 has fixed its units: add the adapter (get_peft_model, "
            "or pass a peft_config to the trainer) before running the model."
        )
    for module in added:  # gathered and freed by `ShardedPasses`, however often a pass runs it
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        module.set_reshard_after_backward(False)
    return added


def receive_first_rank_weights(model: nn.Module) -> bool:
    """Give every rank the first rank's weights where transformers loaded them there only: with an FSDP launch's
    `fsdp_cpu_ram_efficient_loading`, the other ranks hold meta tensors, for Accelerate to broadcast the weights when
    its FSDP wraps the model, which the trainer does not let it do (it shards with FSDP2 itself). Called at the
    trainer's construction, before it wraps, moves or shards the model; one collective to learn whether any rank
    lacks them, then a broadcast of every state-dict tensor from the first rank (each rank then holds the whole
    model until the trainer shards it, as with that loading off). False where nothing was received: every rank holds
    its weights, one process, or the first rank lacks them too (`check_weights_loaded` refuses that)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    tensors = [*model.parameters(), *model.buffers()]
    missing = any(tensor.is_meta for tensor in tensors)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flags = torch.tensor([int(missing), int(missing and dist.get_rank() == 0)], device=device)
    with collective("agreement on which ranks hold the loaded weights"):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags[0] or flags[1]:
        return False
    if missing:
        home = next((tensor.device for tensor in tensors if not tensor.is_meta), torch.device("cpu"))
        # transformers gave the non-persistent buffers (rotary frequencies) their values on every rank: kept
        kept = {name: buffer.clone() for name, buffer in model.named_buffers() if not buffer.is_meta}
        model.to_empty(device=home)
        with torch.no_grad():
            for name, value in kept.items():
                model.get_buffer(name).copy_(value)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    with collective("the first rank's weights"), torch.no_grad():
        for tensor in model.state_dict().values():
            sent = tensor.to(device)
            dist.broadcast(sent, src=0)
            if sent is not tensor:
                tensor.copy_(sent)
    return True


def check_weights_loaded(model: nn.Module) -> None:
    """Before the trainer shards (or moves) a model: every parameter holds its weights on this rank."""
    on_meta = [name for name, param in model.named_parameters() if param.is_meta]
    if on_meta:
        raise ValueError(
            f"shard_weights=True: {on_meta[0]} (and {len(on_meta) - 1} more) hold no weights on this rank (the meta "
            "device), and no other rank can send them (the first rank lacks them too, or this is the only process). "
            "Load the model with its weights, or pass the model id to the trainer."
        )


def load_sharded_kwargs(
    init_kwargs: dict, world_size: int, other_layer_classes: bool, quantized: bool, reference_model: bool
) -> dict:
    """`model_init_kwargs` for a model the trainer loads by id under `shard_weights`: with transformers' load-time
    FSDP2 (`distributed_config=DistributedConfig(fsdp_size=world_size)`), each rank reads only its rows of every
    checkpoint tensor (MoE experts fused at load included) straight into its shards, so no process ever holds the
    whole model. Its plan shards each decoder layer, the embeddings, and the final norm with the LM head (kept gathered
    from forward to backward), then the causal LM as the root.

    Returned unchanged (every rank loads the model whole, then the trainer shards it, `fully_shard_model`) where that
    plan does not apply: a model quantized by bitsandbytes (transformers' sharded loading does not take it),
    `shard_layer_classes` naming other modules than the decoder layers (`other_layer_classes`), and a reference model
    (`reference_model`: beta > 0 without an adapter), which TRL loads from the same kwargs: loaded sharded, it would be
    a second FSDP2 root, whose passes the ranks do not agree on; loaded whole, it is the whole model on every rank
    anyway."""
    if world_size == 1 or quantized or reference_model or other_layer_classes:
        return init_kwargs
    if "distributed_config" in init_kwargs:
        raise ValueError(
            "shard_weights=True with a distributed_config in model_init_kwargs: the trainer loads the model sharded "
            "over every rank itself. Remove distributed_config from model_init_kwargs."
        )
    from transformers.distributed import DistributedConfig

    return {**init_kwargs, "distributed_config": DistributedConfig(fsdp_size=world_size)}


def sharded_loading_kwargs(config, args, quantization_config, peft_config) -> dict:
    """`args.model_init_kwargs` for a model the trainer loads by id under `shard_weights` (`load_sharded_kwargs`),
    from its config and the trainer's `quantization_config` and `peft_config`."""
    # here, not at the top: the planner imports this module and stays clear of TRL's import (config.py imports it)
    from .architectures import model_skeleton
    from .config import loading_quantization, model_init_kwargs, remote_code_trusted

    layers = model_skeleton(config, trust_remote_code=remote_code_trusted(args)).get_decoder().layers
    other_layer_classes = args.shard_layer_classes is not None and set(args.shard_layer_classes) != {
        type(layer).__name__ for layer in layers
    }
    return load_sharded_kwargs(
        model_init_kwargs(args),
        args.world_size,
        other_layer_classes,
        quantized=loading_quantization(args, quantization_config) is not None,
        reference_model=args.beta != 0.0 and peft_config is None,
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


def parallelize(causal_lm: nn.Module, shard_weights: bool, layer_classes: list[str] | None) -> list[nn.Module] | None:
    """Shard the policy with FSDP2 as LongStraw drives it, in this order, and return the adapter units sharded apart
    (empty if none), or None when the model ends unsharded.

    1. QLoRA's 4-bit layout kept (`keep_4bit_layout`): before any forward of a sharded model.
    2. Sharding: every decoder layer (or each of `layer_classes`) and the root, after PEFT's wrapping (TRL's) and
       before the optimizer (`fully_shard_model`); or, for a model loaded sharded, the parameters added after it (an
       adapter TRL added: `shard_added_parameters`).
    3. The layout checked (`check_sharded_layout`).

    `ShardedPasses` takes the result once the pre-flight passes have run on every rank.
    """
    if not shard_weights and not is_sharded(causal_lm):
        return None
    keep_4bit_layout(causal_lm)
    adapter_units = []
    if not is_sharded(causal_lm):
        fully_shard_model(causal_lm, layer_classes)
    else:
        adapter_units = shard_added_parameters(causal_lm)
    check_sharded_layout(causal_lm)
    return adapter_units


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


def reshards_after_forward(module: FSDPModule) -> bool:
    """Whether FSDP2 frees `module`'s gathered weights after its forward (`fully_shard(reshard_after_forward=...)`,
    True by default). transformers' load-time plan keeps the final norm and LM head gathered from their forward to
    their backward (one FSDP2 unit of both): LongStraw keeps them so too."""
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def units_held(root: nn.Module, units: list[nn.Module]) -> dict[nn.Module, list[nn.Module]]:
    """`units` by the innermost other `fully_shard` unit holding each (a decoder layer, else the root)."""
    ids = {id(unit) for unit in units}
    holders = {name: module for name, module in root.named_modules() if isinstance(module, FSDPModule)}
    held: dict[nn.Module, list[nn.Module]] = {}
    for name, module in root.named_modules():
        if id(module) in ids:
            owner = max((n for n in holders if n != name and (n == "" or name.startswith(n + "."))), key=len)
            held.setdefault(holders[owner], []).append(module)
    return held


class ShardedPasses:
    """Keeps the ranks holding one FSDP2 model's shards in step, pass by pass (module docstring).

    Args:
        root: the causal LM, the root `fully_shard` module.
        device: where the ranks' agreement tensor lives (the model's device: gloo on CPU, NCCL on GPU).
        group: the ranks that share the shards.
        adapter_units: `fully_shard` units of adapter layers (`shard_added_parameters`). A pass with the adapter
            disabled does not call them, and a pass through LongStraw's MLA attention calls `kv_b_proj` three times
            where another rank's stand-in pass calls it once: so that every pass gathers the same units in the same
            order, each is gathered when the unit holding it starts its forward and freed when that one ends, and
            gathered again when the holder's backward starts and freed when it ends.
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
        adapter_units: list[nn.Module] = (),
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
            if module is not root and isinstance(module, FSDPModule) and reshards_after_forward(module):
                self._hooks.append(module.register_forward_hook(self._free_after_forward))
        self.adapter_units = list(adapter_units)
        for holder, held in units_held(root, adapter_units).items():
            gather = functools.partial(self._gather, held)
            self._hooks.append(holder.register_forward_pre_hook(gather, with_kwargs=True))
            self._hooks.append(holder.register_forward_hook(functools.partial(self._free, held)))
        self.context_parallel_size = context_parallel_size
        self._free_adapters()  # the pre-flight passes ran before these hooks

    def _before_forward(self, module: nn.Module, args) -> None:
        if not self._standing_in:
            self._agree(BACKWARD if torch.is_grad_enabled() else FORWARD)
        self._free_adapters()
        self._in_pass = True

    def _after_forward(self, module: nn.Module, args, output) -> None:
        self._in_pass = False

    def _gather(self, units: list[FSDPModule], module: nn.Module, args, kwargs) -> None:
        """Adapter units gathered with the unit holding them (`adapter_units`). Under autograd they are freed again
        when the holder's backward has reached its input (a hook on the input's gradient); a holder whose input
        takes no gradient (the first layer over frozen embeddings) keeps them until the next pass starts."""
        for unit in units:
            unit.unshard()
        if torch.is_grad_enabled():
            tensors = (value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
            first = next((tensor for tensor in tensors if tensor.requires_grad), None)
            if first is not None:
                first.register_hook(functools.partial(self._free_in_backward, units))

    def _free(self, units: list[FSDPModule], module: nn.Module, args, output) -> None:
        """... and freed when the holder's forward ends, in a pass of the root. Under autograd, gathered again when
        the holder's backward starts: a hook on its output's gradient, after FSDP2's own (which gathers the holder),
        so every backward gathers the same units in the same order, whatever order the holder's backward then reaches
        them in (an exact-mode prompt chunk's backward also enters each layer at its state entries)."""
        if not self._in_pass:
            return
        for unit in units:
            unit.reshard()
        outputs = output if isinstance(output, tuple | list) else (output,)
        first = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(functools.partial(self._gather_in_backward, units))

    @staticmethod
    def _gather_in_backward(units: list[FSDPModule], grad: torch.Tensor) -> None:
        for unit in units:
            unit.unshard()

    @staticmethod
    def _free_in_backward(units: list[FSDPModule], grad: torch.Tensor) -> None:
        for unit in units:
            unit.reshard()

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
        self._free_adapters()

    def _free_adapters(self) -> None:
        """The adapter units kept from a pass's backward (`adapter_units`) sharded again: what the optimizer, the
        gradient clipping and the next pass read."""
        for unit in self.adapter_units:
            unit.reshard()

    def reduce_gradients(self) -> None:
        """Close the accumulation window: one pass with gradient sync on, on every rank at once, after which FSDP2
        has reduce-scattered every module's accumulated gradient into its sharded `.grad`."""
        self.finish_phase()
        self.root.set_requires_gradient_sync(True)
        try:
            self._zero_pass(BACKWARD)
        finally:
            self.root.set_requires_gradient_sync(False)
        self._free_adapters()
        if self.context_parallel_size > 1:
            for param in self.root.parameters():
                if param.grad is not None:
                    param.grad.mul_(self.context_parallel_size)
        self.synced_passes += 1

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
