import copy
import os

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model, build_tokenizer

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GROUP_SIZE = 3
# transformers' continuous batching with a paged cache sized for the tiny models: TRL's default sizes it at half the
# host's memory, and allocates and resets it for every generation (45 s of a 2-step test on CPU, against 4 s)
TINY_PAGED_CACHE = {"num_blocks": 16, "page_size": 32, "max_batch_tokens": 256}
# The modules that take longest (`pytest --durations`), dealt first to `make test`'s workers, a module at a time, so
# that the workers finish together; the other modules follow in their usual order. Only the order depends on it.
LONGEST_FIRST = (
    "test_fsdp.py",
    "test_simulation.py",
    "test_conformance.py",
    "test_properties.py",
    "test_drop_in.py",
    "test_faults.py",
    "test_preemption.py",
    "test_context_parallel_trainer.py",
    "test_soak.py",
    "test_recipe.py",
    "test_context_parallel.py",
    "test_plan.py",
    "test_families.py",
    "test_rollout.py",
    "test_precision.py",
    "test_load_balancing.py",
    "test_distributed.py",
    "test_end_to_end.py",
)


def pytest_collection_modifyitems(items):
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable: each module keeps its own order


def length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def prompt_dataset():
    return Dataset.from_dict({"prompt": ["the value of key is 42. what is the value of key?", "say hi"] * 4})


def accelerate_launch_env(config_file: str) -> dict[str, str]:
    """The FSDP variables `accelerate launch --config_file config_file` exports to each process (Accelerate's own
    translation of the config), for launching on CPU, where an FSDP config leaves every process alone."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", config_file, "x.py"]))
    return {name: value for name, value in prepare_multi_gpu_env(args).items() if "FSDP" in name}


def trainer_args(config_class, tmp_path, **overrides):
    fields = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 2 * GROUP_SIZE,
        "num_generations": GROUP_SIZE,
        "max_completion_length": 6,
        "report_to": "none",
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_dropout": True,
        "seed": 0,
        "bf16": False,  # transformers defaults to bf16 autocast even on CPU; parity is checked in full precision
    }
    fields.update(overrides)
    return config_class(**fields)


def make_trainer(
    trainer_class,
    model,
    tokenizer,
    dataset,
    tmp_path,
    peft_config=None,
    reward_funcs=length_reward,
    tools=None,
    **overrides,
):
    """A trainer on `model`; LongStraw-only fields are dropped for a stock trainer."""
    config_class = LongStrawGRPOConfig if issubclass(trainer_class, LongStrawGRPOTrainer) else GRPOConfig
    if config_class is GRPOConfig:
        overrides = {k: v for k, v in overrides.items() if k in GRPOConfig.__dataclass_fields__}
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_funcs,
        args=trainer_args(config_class, tmp_path, **overrides),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        tools=tools,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def synthetic_inputs(vocab_size, prompt_lengths=(11, 7), completion_lengths=((6, 3, 5), (2, 6, 1)), seed=0, pad_id=0):
    """Two groups of GROUP_SIZE rows: prompts of different lengths (left-padded), ragged completions."""
    generator = torch.Generator().manual_seed(seed)
    width_p, width_c = max(prompt_lengths), max(max(c) for c in completion_lengths)
    prompt_ids, prompt_mask, completion_ids, completion_mask = [], [], [], []
    for prompt_length, lengths in zip(prompt_lengths, completion_lengths, strict=True):
        prompt = torch.randint(2, vocab_size, (prompt_length,), generator=generator)
        for length in lengths:
            row = torch.full((width_p,), pad_id)
            row[width_p - prompt_length :] = prompt
            prompt_ids.append(row)
            prompt_mask.append((torch.arange(width_p) >= width_p - prompt_length).long())
            completion = torch.full((width_c,), pad_id)
            completion[:length] = torch.randint(2, vocab_size, (length,), generator=generator)
            completion_ids.append(completion)
            completion_mask.append((torch.arange(width_c) < length).long())
    completion_mask = torch.stack(completion_mask)
    return {
        "prompt_ids": torch.stack(prompt_ids),
        "prompt_mask": torch.stack(prompt_mask),
        "completion_ids": torch.stack(completion_ids),
        "completion_mask": completion_mask,
        "advantages": torch.randn(len(completion_mask), generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }


def add_old_and_ref_logps(trainer, inputs, seed=1, spread=0.5):
    """Old/ref log-probs near the current ones, far enough that the PPO clip is active on many tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        current, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, inputs["completion_ids"].shape[1]
        )
    noise = lambda: spread * torch.randn(current.shape, generator=generator)
    inputs = dict(inputs)
    inputs["old_per_token_logps"] = (current + noise()) * inputs["completion_mask"]
    inputs["ref_per_token_logps"] = (current + noise()) * inputs["completion_mask"]
    return inputs


def grads_of(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_relative_error(got, want, floor_fraction=0.0):
    """Largest per-tensor relative error; with `floor_fraction`, norms below that fraction of the global gradient
    norm are measured against the floor instead (docs/design.md: GatedDeltaNet's A_log/dt_bias gradients are tiny sums
    with heavy cancellation, which two exact orderings of the same math disagree on far above rounding)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    floor = floor_fraction * torch.sqrt(sum(w.norm() ** 2 for w in want.values()))
    return max(
        ((got[k] - want[k]).norm() / torch.maximum(want[k].norm(), floor).clamp(min=1e-30)).item() for k in want
    )


@pytest.fixture
def fresh_model(tmp_path):
    """A tiny random model saved to disk and reloaded, so TRL can build a reference model from its path."""

    def factory(model_type="qwen3", dtype=torch.float32, seed=0, **overrides):
        path = tmp_path / f"{model_type}-{seed}"
        build_model(model_type, seed=seed, dtype=dtype, **overrides).save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)

    return factory


def clone_model(model):
    return copy.deepcopy(model)
