"""Three LongStraw optimizer steps, run alone (`python this.py OUT FAMILY/ROUTE ...`) or with the weights sharded by
FSDP2 over the ranks (`torchrun --nproc_per_node 2 this.py OUT FAMILY/ROUTE ...`), in detach and exact mode, for each
case given, one after the other in the same processes (their imports and process group paid once); saves what
`test_fsdp.py` compares. ROUTE: `fully_shard` (the model is sharded here, decoder layers then the causal LM, before the
trainer gets it), `shard_weights` (the trainer shards it), `lora` (the trainer wraps it with LoRA from a `peft_config`,
trains against the reference adapter with `beta > 0`, and shards it), `qlora` (the same on the model loaded in NF4
through bitsandbytes: its packed 4-bit weights sharded too), `loaded` (the model passed by its directory: the trainer
loads it, each rank reading only its shards, transformers' load-time FSDP2), `loaded_lora` (the same with GLM-5's
attention projections adapted by LoRA, added after the weights were sharded, and `beta > 0`), `tools` (one greedy step of the embedded
tool-calling model with `tools=[add]`, sharded by the trainer: the ranks' rows may take different numbers of tool
turns).

Each optimizer step takes 12 rows (4 prompts x 3 generations) in 2 micro-steps: one process takes 6 rows per
micro-step, each of 2 ranks 3. The completions come from a `rollout_func` that writes them from the prompt and the
member's index, so both runs train on the same completions whatever rows a rank holds; the rollout through the sharded
model is checked separately (`rollout`: greedy decoding, whose completions do not depend on the rank either).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import (
    add,
    build_model,
    build_tokenizer,
    build_tool_calling_model,
    build_tool_calling_tokenizer,
)

# FSDP2's collectives, counted (it calls them through `torch.distributed` at each use)
COLLECTIVES = {"all_gather_single": 0, "reduce_scatter_single": 0}


def counted(name: str):
    collective = getattr(dist, name)

    def count(*args, **kwargs):
        COLLECTIVES[name] += 1
        return collective(*args, **kwargs)

    return count


for _name in COLLECTIVES:
    setattr(dist, _name, counted(_name))

PROMPTS = [f"the key is {4217 + i}. " + "lorem ipsum " * (i % 3 + 1) + "what is the key?" for i in range(16)]
COMPLETIONS: list[str] = []


def char_code_reward(completions, **kwargs):
    COMPLETIONS.extend(map(str, completions))
    return [float(sum(map(ord, str(completion))) % 7) for completion in completions]


def written_rollout(prompts, trainer):
    """Completions of 2-5 letters and EOS, a function of the prompt and the member's index in its group. A generation
    batch is whole groups of consecutive rows dealt to the data-parallel ranks in order, so a row's member index is
    its index in the whole batch modulo the group size, whichever rank holds it."""
    tokenizer = trainer.processing_class
    first = trainer.accelerator.process_index // trainer.args.context_parallel_size * len(prompts)
    prompt_ids, completion_ids = [], []
    for index, prompt in enumerate(prompts):
        member = (first + index) % trainer.num_generations
        letters = "".join(
            chr(97 + (len(prompt) * 7 + member * 3 + j) % 26) for j in range(2 + (len(prompt) + member) % 4)
        )
        prompt_ids.append(tokenizer(prompt)["input_ids"])
        completion_ids.append(tokenizer(letters)["input_ids"] + [tokenizer.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


# Variants of the embedded families (FAMILY on the command line): "qwen3_one_row", dense Qwen3 with an MLP of one
# intermediate row, so that each `gate_proj` and `up_proj` has one row and rank 1's shard of it is empty (as a
# per-head `A_log` of 48 heads leaves 16 of 64 ranks).
VARIANTS = {"qwen3_one_row": ("qwen3", {"intermediate_size": 1})}


def family_model(family: str):
    base, overrides = VARIANTS.get(family, (family, {}))
    return build_model(base, seed=0, **overrides)


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def sharded_modules_that_train(model) -> int:
    """`fully_shard` units (one module, or modules sharded together) with a trainable parameter: each reduce-scatters
    its gradients in a synced backward."""
    states = {
        id(state): state for m in model.modules() if isinstance(m, FSDPModule) for state in [m._get_fsdp_state()]
    }
    return sum(
        state._fsdp_param_group is not None
        and any(param.sharded_param.requires_grad for param in state._fsdp_param_group.fsdp_params)
        for state in states.values()
    )


def trainable_weights(model) -> dict[str, torch.Tensor]:
    """Every trainable weight, whole (gathered from its shards)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


class GatheredLayers:
    """The most decoder layers holding gathered (unsharded) weights at once, and the most layers whose adapter units
    (`adapter_units`: an adapter added after sharding) are gathered at once, seen as each layer's forward or backward
    starts: FSDP2 swaps a module's DTensor parameters for whole tensors while it is gathered."""

    def __init__(self, layers, adapter_units=()):
        self.layers, self.most, self.most_adapters = list(layers), 0, 0
        units = {id(unit) for unit in adapter_units}
        self.adapters = [[m for m in layer.modules() if id(m) in units] for layer in self.layers]
        for layer in self.layers:
            layer.register_forward_pre_hook(self.count)
            layer.register_full_backward_pre_hook(self.count)

    def count(self, *unused):
        gathered = sum(not isinstance(next(layer.parameters()), DTensor) for layer in self.layers)
        self.most = max(self.most, gathered)
        adapters = sum(any(not isinstance(u.weight, DTensor) for u in units) for units in self.adapters)
        self.most_adapters = max(self.most_adapters, adapters)


class GradientBytes(TrainerCallback):
    """This rank's gradient bytes when the optimizer steps (the Trainer frees them right after)."""

    def __init__(self):
        self.bytes = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.bytes = max(self.bytes, local_bytes(p.grad for p in model.parameters() if p.grad is not None))


def worker_args(world: int, context_parallel_size: int = 1, **settings) -> LongStrawGRPOConfig:
    """Both runs' settings: 6 rows per micro-step in all (3 per data-parallel rank on 2), fp32 on CPU, no
    checkpoints."""
    return LongStrawGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=6 // (world // context_parallel_size),
        context_parallel_size=context_parallel_size,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=0,
        **settings,
    )


def quantized_model(family: str, out: str):
    """The family's model loaded in NF4 (bitsandbytes), as a QLoRA user loads it: from its weights, which the first
    rank saves (transformers' `save_pretrained` writes on the main process only)."""
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(saved_model(family, out), quantization_config=nf4, dtype=torch.float32)


def saved_model(family: str, out: str, without: str | None = None) -> str:
    """The directory of the family's model, which the first rank saves (`save_pretrained` writes on the main process
    only), optionally `without` one weight in its checkpoint."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    directory = os.path.join(out, f"{family}-base-world{world}" + (f"-without-{without}" if without else ""))
    if not dist.is_initialized() or dist.get_rank() == 0:
        family_model(family).save_pretrained(directory)
        if without is not None:
            checkpoint = os.path.join(directory, "model.safetensors")
            weights = load_file(checkpoint)
            del weights[without]
            save_file(weights, checkpoint, metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()
    return directory


def train(out: str, family: str, route: str, prompt_gradient: str, rollout: bool) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if route == "qlora":
        model = quantized_model(family, out)
    elif route.startswith("loaded"):  # by its directory: the trainer loads it, on several ranks its shards only
        model = saved_model(family, out)
    elif route == "lora":  # loaded by the user after the config (below)
        model = None
    else:
        model = family_model(family)
    if world > 1 and route in ("fully_shard", "hybrid_shard"):
        # "hybrid_shard": 4 ranks, FSDP2 inside each context-parallel group of 2 (the mesh's rows), replicated across
        # the groups (its columns)
        mesh = (
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if route == "hybrid_shard" else None
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # "ragged": groups of 4 over micro-steps of 3 rows per rank, one-token prompts, an evaluation; "load_balancing": the
    # MoE load-balancing loss. "<route>_unsharded": the same on data-parallel ranks without FSDP2 (what the sharded
    # run must equal where one process is not the reference: TRL's eval loss and load-balancing loss are per-rank)
    ragged = route.startswith("ragged")
    args = worker_args(
        world,
        2 if world > 1 and route in ("context_parallel", "hybrid_shard") else 1,
        num_generations=4 if ragged else 3,
        per_device_eval_batch_size=4,  # one group per eval batch on every run: the eval loss is a mean over batches
        gradient_accumulation_steps=2,
        max_completion_length=6,
        max_steps=1 if rollout else 3,
        prompt_gradient=prompt_gradient,
        prefill_chunk_size=8,
        attention_chunk_size=8,
        replay_segment_size=2 if route == "segments" else None,
        generation_kwargs={"top_k": 1} if rollout else None,
        # an FSDP2 accelerate config's launch (ACCELERATE_USE_FSDP) sets it through the config instead
        shard_weights=world > 1
        and route not in ("fully_shard", "hybrid_shard")
        and not route.endswith("_unsharded")
        and "ACCELERATE_USE_FSDP" not in os.environ,
        router_aux_loss_coef=0.5 if route.startswith("load_balancing") else None,
        beta=0.04 if route in ("lora", "qlora", "loaded_lora") else 0.0,
        # TRL keeps QLoRA's adapters in bf16, where AdamW's first steps turn a one-ulp difference in a near-zero
        # gradient into a whole step of the other sign; SGD's update is the gradient's, compared to bf16's precision.
        # LoRA: the single-tensor AdamW, whose writes move the sharded parameters' version counters (the weights
        # stamp, engine.weights_version); otherwise TRL's default, fused AdamW.
        optim={"qlora": "sgd", "lora": "adamw_torch"}.get(route, "adamw_torch_fused"),
    )
    loaded_on_meta = None
    if model is None:
        # as a user loads it once the config exists, from a checkpoint without the final norm's weight: under an FSDP
        # launch's fsdp_cpu_ram_efficient_loading (TRL's fsdp2.yaml), transformers initialises a missing weight on
        # the first rank only and leaves the other ranks' on the meta device, for Accelerate to broadcast
        model = AutoModelForCausalLM.from_pretrained(saved_model(family, out, without="model.norm.weight"))
        loaded_on_meta = any(param.is_meta for param in model.parameters())
    lora = None
    if route in ("lora", "qlora"):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    elif route == "loaded_lora":  # GLM-5's attention projections (the model is glm_moe_dsa)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj", "o_proj"])
    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["k", "?", *PROMPTS] if ragged else PROMPTS}),
        processing_class=build_tokenizer(),
        rollout_func=None if rollout else written_rollout,
        peft_config=lora,
    )
    initial = trainable_weights(trainer.model)
    gathered = None
    if world > 1:
        adapter_units = trainer._sharded.adapter_units if trainer._sharded is not None else ()
        gathered = GatheredLayers(trainer.model.get_decoder().layers, adapter_units)
    gradient_bytes = GradientBytes()
    trainer.add_callback(gradient_bytes)
    COMPLETIONS.clear()
    counted_before = dict(COLLECTIVES)
    trainer.train()
    if rollout:
        return {"completions": list(COMPLETIONS)}
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    params = list(trainer.model.parameters())
    state = [value for per_param in trainer.optimizer.state.values() for value in per_param.values() if value.dim()]
    report = {
        "loss": [entry["loss"] for entry in logged],
        "aux_loss": [entry.get("aux_loss") for entry in logged],
        "grad_norm": [entry["grad_norm"] for entry in logged],
        "weights": trainable_weights(trainer.model),
        "initial": initial,
        "bytes": {
            "parameters": local_bytes(params),
            "gradients": gradient_bytes.bytes,
            "optimizer": local_bytes(state),
            "whole_parameters": sum(p.numel() * p.element_size() for p in params),
        },
        # transformers' load-time FSDP2 records its configuration on the model it loaded sharded
        "loaded_sharded": getattr(trainer.model.config, "distributed_config", None) is not None,
        "loaded_on_meta": loaded_on_meta,
        "accelerate_use_fsdp": os.environ.get("ACCELERATE_USE_FSDP"),  # as the trainer left it for Accelerate
        "synced_passes": trainer._sharded.synced_passes if trainer._sharded is not None else None,
        "stand_ins": trainer._sharded.stand_ins if trainer._sharded is not None else None,
        "rounds": trainer._sharded.rounds if trainer._sharded is not None else None,
        "most_layers_gathered": gathered.most if gathered is not None else None,
        "most_adapter_layers_gathered": gathered.most_adapters if gathered is not None else None,
        "adapter_units": len(trainer._sharded.adapter_units) if trainer._sharded is not None else 0,
        "layers": len(trainer.model.get_decoder().layers),
        "optimizer_steps": trainer.state.global_step,
        "collectives": {name: COLLECTIVES[name] - counted_before[name] for name in COLLECTIVES},
        "sharded_modules": sharded_modules_that_train(trainer.model),
        # parameters of which this rank holds no rows (fewer rows than ranks)
        "empty_shards": [
            name
            for name, p in trainer.model.named_parameters()
            if isinstance(p, DTensor) and p.to_local().numel() == 0
        ],
    }
    if ragged:  # after the bytes are counted: FSDP2 keeps the root module gathered after its forward
        evaluated = trainer.evaluate(Dataset.from_dict({"prompt": ["k", *PROMPTS[:3]]}))
        report["eval"] = {key: evaluated[key] for key in ("eval_loss", "eval_reward")}
    return report


def tool_rollout() -> dict:
    """One greedy step of the tool-calling model (~750 prompt tokens: the tool schema), the trainer sharding it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokenizer = build_tool_calling_tokenizer()
    args = worker_args(
        world,
        num_generations=3,
        max_completion_length=48,
        max_steps=1,
        prefill_chunk_size=128,
        attention_chunk_size=128,
        generation_kwargs={"top_k": 1},
        shard_weights=world > 1,
    )
    prompts = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    trainer = LongStrawGRPOTrainer(
        model=build_tool_calling_model(tokenizer),
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        tools=[add],
    )
    COMPLETIONS.clear()
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    return {"completions": list(COMPLETIONS), "tool_calls": logged["tools/call_frequency"]}


def main(out: str, *cases: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    for case in cases:
        run_case(out, *case.split("/"))


def run_case(out: str, family: str, route: str) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if route == "tools":
        results = {"rollout": tool_rollout()}
    else:
        results = {mode: train(out, family, route, mode, rollout=False) for mode in ("detach", "exact")}
        results["rollout"] = train(out, family, route, "detach", rollout=True)
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, results["rollout"]["completions"])
        results["rollout"]["completions"] = [c for rank_completions in everyone for c in rank_completions]
    torch.save(results, f"{out}/{family}-{route}-world{world}-rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
