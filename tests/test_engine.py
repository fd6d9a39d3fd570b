"""Capture + score + replay against a single full forward (DESIGN.md ladder 2 and 6), stale state, numerics."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.attention import ATTENTION_IMPLEMENTATION, register_attention
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine, NonFiniteError
from trl_longstraw.state import LinearAttentionState, StaleStateError


def prepared(model):
    register_attention()
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def full_forward(model, prompt, completions, lengths, offset=0):
    """Stock path: one forward of prompt + completion per member, log-probs of the completion tokens."""
    rows = []
    for completion, length in zip(completions, lengths, strict=True):
        ids = torch.cat([prompt, completion])[None]
        labels = ids.clone()
        labels[:, : prompt.numel()] = -100
        labels[:, prompt.numel() + int(length) :] = -100
        positions = torch.arange(offset, offset + ids.shape[1], device=ids.device)[None]
        out = model(input_ids=ids, position_ids=positions, labels=labels, fused_lm_head=True)
        rows.append((out.log_probs[0, -completions.shape[1] :], out.entropy[0, -completions.shape[1] :]))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def case(seed=0, prompt_length=29, completion_width=7, vocab=100):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, vocab, (prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (3, completion_width), generator=generator)
    lengths = torch.tensor([completion_width, 3, 5])
    return prompt, completions, lengths


MISTRAL_SLIDING = dict(
    vocab_size=102,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=6,
)


# glm_moe_dsa: index_topk 64 >= every sequence here (dense selection); glm_moe_dsa-sparse: top-12 of up to 36 keys.
# DSA's top-k is discontinuous at ties, which ReLU makes common (a key every index head scores negative gets exactly
# 0): the sparse case uses 32 index heads so that no key scores exactly 0 and no tie sits at the selection boundary.
@pytest.mark.parametrize(
    "model_type", ["qwen3", "llama", "mistral-sliding", "qwen3_5", "glm_moe_dsa", "glm_moe_dsa-sparse"]
)
@pytest.mark.parametrize("prefill_chunk, attention_chunk", [(1000, 1000), (4, 3), (7, 1)])
def test_score_matches_full_forward(model_type, prefill_chunk, attention_chunk):
    if model_type == "mistral-sliding":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(MistralConfig(**MISTRAL_SLIDING))
    elif model_type == "glm_moe_dsa-sparse":
        model = build_model("glm_moe_dsa", index_topk=12, index_n_heads=32)
    else:
        model = build_model(model_type)
    model = prepared(model)
    prompt, completions, lengths = case()
    engine = LongStrawEngine(prefill_chunk, attention_chunk)
    with torch.no_grad():
        want_logps, want_entropies = full_forward(model, prompt, completions, lengths, offset=5)
        state = engine.capture(model, prompt, first_position=5)
        logps, entropies = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=2)
    assert (logps - want_logps).abs().max() <= 1e-5
    assert (entropies - want_entropies).abs().max() <= 1e-5
    assert torch.all(logps[1, 3:] == 0) and torch.all(logps[2, 5:] == 0)


def test_sliding_window_state_keeps_only_the_window():
    torch.manual_seed(0)
    model = prepared(AutoModelForCausalLM.from_config(MistralConfig(**MISTRAL_SLIDING)))
    prompt, _, _ = case()
    state = LongStrawEngine(4, 3).capture(model, prompt, first_position=0)
    assert all(pages.key.shape[1] == MISTRAL_SLIDING["sliding_window"] - 1 for pages in state.layers.values())


@pytest.mark.parametrize(
    "model_type, prompt_gradient",
    [
        ("qwen3", "detach"),
        ("qwen3_5", "detach"),
        ("qwen3_5", "exact"),
        ("glm_moe_dsa", "detach"),
        ("glm_moe_dsa", "exact"),
    ],
)
def test_replay_matches_score_and_leaves_the_state_bitwise_unchanged(model_type, prompt_gradient):
    model = prepared(build_model(model_type))
    prompt, completions, lengths = case()
    engine = LongStrawEngine(8, 5, prompt_gradient=prompt_gradient)
    state = engine.capture(model, prompt, first_position=0)
    if prompt_gradient == "exact":
        state.requires_grad_()
    before = [t.detach().clone() for t in state.tensors()]
    scored, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    for member in range(3):
        logps, entropies = engine.replay(model, state, prompt[-1:], completions[member], int(lengths[member]))
        (logps.sum() + entropies.sum()).backward()
        assert torch.allclose(logps.detach(), scored[member, : int(lengths[member])], atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, state.tensors(), strict=True))
    if prompt_gradient == "exact":  # the state the replays read received their gradient (earlier chunk boundaries
        # of linear-attention layers only get theirs in the prompt backward)
        for layer in state.layers.values():
            if isinstance(layer, LinearAttentionState):
                read = [layer.conv[-1], layer.recurrent[-1]]
            else:
                read = layer.tensors() if layer.differentiable else []
            assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in read)


def test_gated_deltanet_state_size_is_independent_of_the_prompt_length():
    model = prepared(build_model("qwen3_5"))
    engine = LongStrawEngine(16, 16)
    short, long = (engine.capture(model, case(prompt_length=n)[0], 0) for n in (20, 60))

    def shapes(state, kind):
        return [t.shape for key in sorted(state.layers) if key[1] == kind for t in state.layers[key].tensors()]

    assert shapes(short, "LinearAttentionState") == shapes(long, "LinearAttentionState")
    assert [s[1] + 40 for s in shapes(short, "AttentionPages")] == [s[1] for s in shapes(long, "AttentionPages")]


def test_state_holds_kv_pages_of_all_but_the_last_prompt_token():
    model = prepared(build_model("qwen3", num_hidden_layers=3))
    prompt, _, _ = case(prompt_length=40)
    state = LongStrawEngine(16, 16).capture(model, prompt, first_position=0)
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    assert state.nbytes() == per_token * 39


def test_stale_state_is_refused():
    model = prepared(build_model("qwen3"))
    prompt, completions, lengths = case()
    engine = LongStrawEngine(8, 8)
    state = engine.capture(model, prompt, first_position=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    optimizer.step()
    with pytest.raises(StaleStateError, match="Capture the prompt again"):
        engine.replay(model, state, prompt[-1:], completions[0], int(lengths[0]))


def test_non_finite_prompt_state_is_reported_at_capture():
    model = prepared(build_model("qwen3"))
    prompt, _, _ = case()
    with torch.no_grad():
        model.model.embed_tokens.weight[prompt[3]] = float("nan")
    with pytest.raises(NonFiniteError, match="captured prompt state"):
        LongStrawEngine(8, 8).capture(model, prompt, first_position=0)


def test_prompt_state_on_cpu_gives_the_same_scores():
    model = prepared(build_model("qwen3"))
    prompt, completions, lengths = case()
    on_model = LongStrawEngine(8, 4)
    on_cpu = LongStrawEngine(8, 4, state_device=torch.device("cpu"))
    with torch.no_grad():
        a, _ = on_model.score(model, on_model.capture(model, prompt, 0), prompt[-1:], completions, lengths, 3)
        state = on_cpu.capture(model, prompt, 0)
        b, _ = on_cpu.score(model, state, prompt[-1:], completions, lengths, 3)
    assert all(t.device.type == "cpu" for t in state.tensors())
    assert torch.equal(a, b)
