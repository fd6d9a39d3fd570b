"""LoRA on fused MoE experts applied to the routed tokens (experts.py) against PEFT's merged path."""

import copy

import peft
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import prepare_model
from trl_longstraw.experts import EXPERTS_IMPLEMENTATION, lora_experts

from .test_drop_in import assert_same_run, train_run

# PEFT 0.21 turns these names into LoRA on the fused expert tensors of GLM-5 and DeepSeek-V3; Mixtral's and gpt_oss's
# (experts stored transposed, with biases) are targeted by parameter name.
EXPERT_TARGETS = {
    "glm_moe_dsa": {"target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "deepseek_v3": {"target_modules": ["gate_proj", "up_proj", "down_proj", "q_a_proj"]},
    "mixtral": {"target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
    "gpt_oss": {"target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
}


def lora_model(family, targets, rank=4, **overrides):
    # init_lora_weights=False: B is random too, so the adapters change the output and receive gradients in both factors
    config = peft.LoraConfig(r=rank, lora_alpha=8, init_lora_weights=False, **targets)
    return peft.get_peft_model(build_model(family, **overrides), config)


def forward_backward(model, input_ids):
    model.zero_grad()
    logits = model(input_ids=input_ids).logits
    logits.sin().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def relative_error(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    ("family", "rank"),
    # rank 3: 12 bytes per fp32 row, off the grouped GEMM's 16-byte strides (padded with zeros)
    [(family, 4) for family in EXPERT_TARGETS] + [("glm_moe_dsa", 3)],
)
def test_matches_peft_merged_experts(family, rank):
    stock = lora_model(family, EXPERT_TARGETS[family], rank)
    ours = prepare_model(copy.deepcopy(stock))
    assert ours.config._experts_implementation == EXPERTS_IMPLEMENTATION
    input_ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(0))
    want_logits, want_grads = forward_backward(stock, input_ids)
    logits, grads = forward_backward(ours, input_ids)
    assert relative_error(logits, want_logits) < 1e-5
    assert grads.keys() == want_grads.keys()
    assert any("lora" in name and "experts" in name for name in grads)
    for name in want_grads:
        assert relative_error(grads[name], want_grads[name]) < 1e-4, name


def test_adapters_disabled_read_the_base_experts():
    stock = lora_model("glm_moe_dsa", EXPERT_TARGETS["glm_moe_dsa"])
    ours = prepare_model(copy.deepcopy(stock))
    input_ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    with stock.disable_adapter(), ours.disable_adapter(), torch.no_grad():
        assert relative_error(ours(input_ids=input_ids).logits, stock(input_ids=input_ids).logits) < 1e-6


class StackSizedResults(TorchDispatchMode):
    """Counts the new tensors (no views, no in-place results) of at least `numel` values the ops return."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            results = out if isinstance(out, (tuple, list)) else (out,)
            self.count += sum(isinstance(t, torch.Tensor) and t.numel() >= self.numel for t in results)
        return out


def stack_sized_results(model, input_ids, numel):
    with StackSizedResults(numel) as forward:
        loss = model(input_ids=input_ids).logits.sum()
    with StackSizedResults(numel) as backward:
        loss.backward()
    return forward.count, backward.count


def test_no_merged_expert_stack_is_kept_or_differentiated():
    # 16 experts: each fused tensor (16 x 64 x 64, 16 x 64 x 32) outsizes every activation of 13 tokens
    stock = lora_model("glm_moe_dsa", EXPERT_TARGETS["glm_moe_dsa"], n_routed_experts=16)
    ours = prepare_model(copy.deepcopy(stock))
    experts = [m for m in ours.modules() if type(m).__name__.endswith("Experts")]
    smallest = min(t.numel() for m in experts for t in (m.gate_up_proj, m.down_proj))
    adapted = 2 * len(experts)
    input_ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(2))
    # PEFT's merge: the registration check's and the forward's merged stacks, and their gradient in the backward
    assert stack_sized_results(stock, input_ids, smallest) == (2 * adapted, adapted)
    # LongStraw's: the registration check's stack only (torch evaluates a parametrization as it registers it), freed
    assert stack_sized_results(ours, input_ids, smallest) == (adapted, 0)


def test_only_lora_on_experts_changes_the_implementation():
    dense_lora = prepare_model(lora_model("glm_moe_dsa", {"target_modules": ["q_a_proj", "kv_b_proj"]}))
    assert not lora_experts(dense_lora)
    assert dense_lora.config._experts_implementation != EXPERTS_IMPLEMENTATION
    assert lora_experts(lora_model("glm_moe_dsa", EXPERT_TARGETS["glm_moe_dsa"]))


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "glm_moe_dsa"
    build_model("glm_moe_dsa", seed=0).save_pretrained(path)
    return path


def test_a_lora_on_experts_run_trains_like_stock(saved_moe, tokenizer, prompt_dataset, tmp_path):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "kv_b_proj"])
    settings = {"learning_rate": 1e-2, "beta": 0.04}  # beta: the reference pass runs with the adapters disabled
    stock = train_run(GRPOTrainer, saved_moe, tokenizer, prompt_dataset, tmp_path, copy.deepcopy(lora), **settings)
    ours = train_run(LongStrawGRPOTrainer, saved_moe, tokenizer, prompt_dataset, tmp_path, lora, **settings)
    assert ours[-1].model.base_model.model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert any("experts" in name for name in ours[3])  # the adapters on the fused experts trained
    assert_same_run(stock, ours)
