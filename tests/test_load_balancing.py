"""The MoE load-balancing loss (`router_aux_loss_coef != 0`): summed apart, it is transformers' loss, its gradient
and stock GRPOTrainer's whole update."""

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.load_balancing import MoeRouting, RouterLoad, moe_routing

from .conftest import max_relative_error
from .reference import AGAINST_THE_REFERENCE, assert_matches_the_reference, run_pair
from .test_drop_in import assert_same_run, train_run
from .test_engine import case, full_forward, prepared

ROUTING = MoeRouting(num_experts=6, top_k=2)
COEF = 0.5  # large enough that the load-balancing loss's share of the gradient is far above the tolerance


def test_sums_taken_apart_give_transformers_loss_and_gradient():
    """A prompt shared by 3 rows (counted once per row) plus each row's own tokens, some masked, at 3 MoE layers."""
    generator = torch.Generator().manual_seed(0)
    prompt = [torch.randn(5, ROUTING.num_experts, generator=generator, requires_grad=True) for _ in range(3)]
    members = [
        [torch.randn(4, ROUTING.num_experts, generator=generator, requires_grad=True) for _ in range(3)]
        for _ in range(3)
    ]
    member_masks = [torch.tensor([1.0, 1, 1, 0]), torch.tensor([1.0, 0, 0, 0]), torch.ones(4)]

    leaves = prompt + [logits for own in members for logits in own]
    rows = [[torch.cat([p, m]) for p, m in zip(prompt, own, strict=True)] for own in members]
    whole = tuple(torch.cat(layer) for layer in zip(*rows, strict=True))
    mask = torch.cat([torch.cat([torch.ones(5), m]) for m in member_masks])
    want = load_balancing_loss_func(whole, ROUTING.num_experts, ROUTING.top_k, mask)
    want_grads = torch.autograd.grad(want, leaves)

    prompt_load = RouterLoad.of(tuple(prompt), ROUTING, torch.ones(5))
    member_loads = [RouterLoad.of(tuple(own), ROUTING, m) for own, m in zip(members, member_masks, strict=True)]
    total = prompt_load.times(3) + sum(member_loads[1:], member_loads[0])  # loss and weights read no graph
    assert torch.allclose(total.loss(ROUTING), want, rtol=1e-6)

    weights = total.weights(ROUTING, torch.tensor(1.0))
    parts = [prompt_load.objective(weights * 3)] + [load.objective(weights) for load in member_loads]
    got_grads = torch.autograd.grad(sum(parts), leaves)
    for got, expected in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-8)


def check_engine_against_a_full_backward(model_type: str, device: str) -> None:
    """Exact mode at the engine: `sum(logps) + COEF * aux` from a capture, member loads and replays, against one full
    forward per member (its router logits from the backbone) and transformers' loss over all of them."""
    model = prepared(build_model(model_type)).to(device)
    routing = moe_routing(model)
    prompt, completions, lengths = (t.to(device) for t in case(prompt_length=40))
    want_logps, _ = full_forward(model, prompt, completions, lengths)
    router_logits, routed = [], []
    for completion, length in zip(completions, lengths, strict=True):
        out = model.base_model(input_ids=torch.cat([prompt, completion])[None], output_router_logits=True)
        router_logits.append(out.router_logits)
        routed.append(torch.cat([torch.ones(prompt.numel() + int(length)), torch.zeros(len(completion) - length)]))
    config = model.config.get_text_config()
    layers = tuple(torch.cat(layer) for layer in zip(*router_logits, strict=True))
    want_aux = load_balancing_loss_func(layers, config.num_experts, config.num_experts_per_tok, torch.cat(routed))
    (want_logps.sum() + COEF * want_aux).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    engine = LongStrawEngine(16, 12, prompt_gradient="exact", routing=routing)
    state = engine.capture(model, prompt, 0).requires_grad_()
    with torch.no_grad():
        _, _, members = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=1, router_load=True)
    total = state.router_load.times(len(completions)) + members
    assert torch.allclose(total.loss(routing), want_aux.detach(), rtol=1e-5)
    weights = total.weights(routing, torch.tensor(COEF, device=device))
    for member in range(len(completions)):
        logps, _, load = engine.replay(
            model, state, prompt[-1:], completions[member], int(lengths[member]), router_load=True
        )
        (logps.sum() + load.objective(weights)).backward()
    engine.backward_prompt(model, state, prompt, weights * len(completions))
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max_relative_error(got, want, floor_fraction=1e-3) <= 1e-4  # A_log/dt_bias: docs/design.md


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe", "gpt_oss"])
def test_engine_gradients_match_a_full_backward(model_type):
    check_engine_against_a_full_backward(model_type, "cpu")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
@AGAINST_THE_REFERENCE
def test_loss_and_gradients_match_the_reference(
    prompt_gradient, reference_class, model_type, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    """Left-padded prompts of two lengths, ragged completions, prompt chunks of 4 tokens."""
    ref_loss, loss, ref_grads, grads = run_pair(
        reference_class,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        model_type=model_type,
        router_aux_loss_coef=COEF,
        prompt_gradient=prompt_gradient,
        beta=0.04,
    )
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads, floor_fraction=1e-3)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_a_one_token_prompt_and_an_empty_member_count_as_in_stock(
    model_type, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    """A one-token prompt captures nothing (zero sums); an empty member still routes its last prompt token."""
    ref_loss, loss, ref_grads, grads = run_pair(
        GRPOTrainer,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        model_type=model_type,
        batch_shape={"prompt_lengths": (1, 7), "completion_lengths": ((6, 0, 5), (2, 6, 1))},
        router_aux_loss_coef=COEF,
        prompt_gradient="exact",
    )
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads, floor_fraction=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("replay_segment_size", [None, 2])
def test_reentrant_checkpointing_gives_the_loss_no_gradient_as_in_stock(
    replay_segment_size, tokenizer, prompt_dataset, tmp_path
):
    """Reentrant checkpointing runs the router under no_grad: stock's load-balancing loss gets no gradient, so
    LongStraw's does not either (it warns), in the replay (whole, or in segments) and in exact mode's prompt
    backward."""
    path = tmp_path / "qwen3_moe"
    build_model("qwen3_moe", seed=0).save_pretrained(path)
    settings = {
        "router_aux_loss_coef": COEF,
        "max_steps": 2,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": True},
        "replay_segment_size": replay_segment_size,
    }
    stock = train_run(GRPOTrainer, path, tokenizer, prompt_dataset, tmp_path, **settings)
    with pytest.warns(UserWarning, match="load-balancing loss gets no gradient"):
        ours = train_run(LongStrawGRPOTrainer, path, tokenizer, prompt_dataset, tmp_path, **settings)
    assert_same_run(stock, ours)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_exact_mode_trains_like_stock(model_type, tokenizer, prompt_dataset, tmp_path):
    """Several optimizer steps: groups spread over micro-steps, all-truncated members (masked, yet their prompt
    tokens' routing counts), a flat-reward step (the load-balancing loss is its only gradient) and evaluation.

    (Not the GatedDeltaNet hybrid: AdamW turns its `A_log`/`dt_bias` rounding-level gradient differences into
    percent-level weight differences over steps, docs/design.md; its gradient is checked above, on one batch.)"""
    path = tmp_path / model_type
    build_model(model_type, seed=0).save_pretrained(path)
    settings = {
        "router_aux_loss_coef": COEF,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 3,
        "max_steps": 3,
        "mask_truncated_completions": True,
        "max_completion_length": 4,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "num_generations_eval": 3,
        "per_device_eval_batch_size": 3,
    }
    stock = train_run(GRPOTrainer, path, tokenizer, prompt_dataset, tmp_path, **settings)
    ours = train_run(LongStrawGRPOTrainer, path, tokenizer, prompt_dataset, tmp_path, **settings)
    assert_same_run(stock, ours)
    for got, want in zip(ours[0] + ours[1], stock[0] + stock[1], strict=True):
        key = "aux_loss" if "aux_loss" in want else "eval_aux_loss"
        assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got[key], want[key])
    assert any(entry["frac_reward_zero_std"] == 1.0 for entry in stock[0])
    assert any(entry["completions/clipped_ratio"] > 0 for entry in stock[0])


@pytest.mark.slow
def test_bf16_autocast_is_as_close_to_stock_as_stock_bf16(tokenizer, prompt_dataset, tmp_path):
    """The routing sums are taken under the forward's autocast, as stock's loss is: in bf16 the logged load-balancing
    loss and the grad norm stay as close to stock's fp32 run as stock's own bf16 run is."""
    path = tmp_path / "qwen3_moe"
    build_model("qwen3_moe", seed=0).save_pretrained(path)
    args = {"max_steps": 1, "router_aux_loss_coef": COEF, "per_device_train_batch_size": 3}
    stock_fp32 = train_run(GRPOTrainer, path, tokenizer, prompt_dataset, tmp_path / "fp32", **args)
    stock_bf16 = train_run(GRPOTrainer, path, tokenizer, prompt_dataset, tmp_path / "bf16", bf16=True, **args)
    ours_bf16 = train_run(LongStrawGRPOTrainer, path, tokenizer, prompt_dataset, tmp_path, bf16=True, **args)
    assert ours_bf16[2] == stock_bf16[2]  # the same samples
    for key in ("aux_loss", "grad_norm"):
        want = stock_fp32[0][0][key]
        stock_error, our_error = abs(stock_bf16[0][0][key] - want), abs(ours_bf16[0][0][key] - want)
        assert our_error <= 2 * stock_error + 1e-3 * abs(want), (key, our_error, stock_error)
