"""The engine's own contracts: what a capture keeps, one-token prompts, stale state, numerics, the prepared-model
guard, host-resident state. Every family's ladder levels are in `test_families.py`."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Llama4TextConfig
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine, prepare_model, weights_version
from trl_longstraw.state import (
    AttentionPages,
    LatentPages,
    LinearAttentionState,
    StaleStateError,
    UnpreparedModelError,
)


def prepared(model):
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def reference_and_prepared(model):
    """`(an eager copy of model, model prepared for LongStraw)`, both with TRL's fused LM head: the reference forward
    and the model under test."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    add_fused_lm_head(eager, outputs=("log_probs", "entropy"))
    return eager, prepared(model)


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


def chunked_attention_model(chunk_size=8):
    """Llama 4 text, random weights: three chunked-attention (RoPE) layers, then a full-attention (NoPE) layer."""
    config = Llama4TextConfig(
        vocab_size=102,
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        interleave_moe_layer_step=1,
        attention_chunk_size=chunk_size,
        attn_temperature_tuning=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.base_model_prefix = "model"  # TRL's fused LM head finds the backbone by it (the class says language_model)
    return model


def case(seed=0, prompt_length=29, completion_width=7, vocab=100):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, vocab, (prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (3, completion_width), generator=generator)
    lengths = torch.tensor([completion_width, 3, 5])
    return prompt, completions, lengths


def test_sliding_window_state_keeps_only_the_window():
    model = prepared(build_model("mistral"))
    prompt, _, _ = case()
    state = LongStrawEngine(4, 3).capture(model, prompt, first_position=0)
    window = model.config.sliding_window
    assert all(pages.key.read().shape[1] == window - 1 for pages in state.layers)
    assert state.layers[0].first_entry == prompt.numel() - 1 - (window - 1)


def test_exact_mode_keeps_every_entry_of_a_sliding_window_layer():
    model = prepared(build_model("mistral"))
    prompt, _, _ = case()
    state = LongStrawEngine(4, 3, prompt_gradient="exact").capture(model, prompt, first_position=0)
    assert all(pages.key.read().shape[1] == prompt.numel() - 1 for pages in state.layers)


def test_gated_deltanet_state_size_is_independent_of_the_prompt_length():
    model = prepared(build_model("qwen3_5"))
    engine = LongStrawEngine(16, 16)
    short, long = (engine.capture(model, case(prompt_length=n)[0], 0) for n in (20, 60))

    def shapes(state, kind):
        return [t.shape for layer in state.layers if isinstance(layer, kind) for t in layer.tensors()]

    assert shapes(short, LinearAttentionState) == shapes(long, LinearAttentionState)
    assert [s[1] + 40 for s in shapes(short, AttentionPages)] == [s[1] for s in shapes(long, AttentionPages)]


def test_state_holds_kv_pages_of_all_but_the_last_prompt_token():
    model = prepared(build_model("qwen3", num_hidden_layers=3))
    prompt, _, _ = case(prompt_length=40)
    state = LongStrawEngine(16, 16).capture(model, prompt, first_position=0)
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    assert state.nbytes() == per_token * 39


@pytest.mark.parametrize(
    "optimizer", [{"name": "SGD"}, {"name": "AdamW", "foreach": False}, {"name": "AdamW", "fused": True}]
)
def test_stale_state_is_refused(optimizer):
    """Fused AdamW (TRL's default) writes the weights without moving their autograd version counters."""
    optimizer = dict(optimizer)
    model = prepared(build_model("qwen3"))
    prompt, completions, lengths = case()
    engine = LongStrawEngine(8, 8)
    state = engine.capture(model, prompt, first_position=0)
    step = getattr(torch.optim, optimizer.pop("name"))(model.parameters(), lr=0.1, **optimizer)
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    step.step()
    with pytest.raises(StaleStateError, match="Capture the prompt again"):
        engine.replay(model, state, prompt[-1:], completions[0], int(lengths[0]))


def test_lora_on_fused_experts_leaves_the_weights_version_where_its_values_are():
    """PEFT's LoRA on parameters (fused MoE experts) re-parametrizes them in every forward, bumping the frozen base
    parameters' version counters: no staleness; a write to a LoRA value still is one."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_model("gpt_oss"), LoraConfig(target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    )
    before = weights_version(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[2, 3, 4]]))
    assert weights_version(model) == before
    lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.add_(1.0)
    assert weights_version(model) != before


def test_a_non_finite_prompt_state_names_its_first_non_finite_layer():
    model = prepared(build_model("qwen3"))
    prompt, _, _ = case()
    assert LongStrawEngine(8, 8).capture(model, prompt, first_position=0).first_non_finite_layer() is None
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("inf")
    state = LongStrawEngine(8, 8).capture(model, prompt, first_position=0)
    assert not state.all_finite()
    assert state.first_non_finite_layer() == "decoder layer 1 (AttentionPages)"


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


@pytest.mark.parametrize("prompt_length", [1, 2])  # an empty state; a one-entry state
@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen3_5", "nemotron_h", "deepseek_v3", "glm_moe_dsa"])
def test_a_one_or_two_token_prompt_scores_and_replays_from_its_captured_tokens(family, prompt_length):
    model = prepared(build_model(family))
    prompt, completions, lengths = case(prompt_length=prompt_length)
    engine = LongStrawEngine(8, 4)
    with torch.no_grad():
        want, _ = full_forward(model, prompt, completions, lengths, offset=3)
        state = engine.capture(model, prompt, first_position=3)
        scored, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    assert state.num_tokens == prompt_length - 1 and (state.nbytes() == 0) == (prompt_length == 1)
    assert (scored - want).abs().max() <= 1e-5
    logps, _ = engine.replay(model, state, prompt[-1:], completions[0], int(lengths[0]))
    assert torch.allclose(logps.detach(), scored[0], atol=1e-6)


def test_members_without_completion_tokens_score_zeros():
    """Every member truncated to nothing (or masked): stock's log-probs are zeros there, which the loss masks."""
    model = prepared(build_model("qwen3"))
    prompt, completions, _ = case()
    engine = LongStrawEngine(8, 4)
    with torch.no_grad():
        state = engine.capture(model, prompt, first_position=0)
        logps, _ = engine.score(model, state, prompt[-1:], completions, torch.zeros(3, dtype=torch.long), 2)
    assert torch.equal(logps, torch.zeros(completions.shape))


def test_chunked_attention_counts_its_chunks_from_the_first_prompt_token():
    """Llama 4's chunks start at the first real token (HF counts them past the left padding): a prompt at position 5
    keeps the 4 entries of its current chunk, and scores and replays as the model's own forward."""
    model = chunked_attention_model(chunk_size=8)
    eager, model = reference_and_prepared(model)
    prompt, completions, lengths = case(prompt_length=21)
    engine = LongStrawEngine(8, 4)
    with torch.no_grad():
        want, _ = full_forward(eager, prompt, completions, lengths, offset=5)
        state = engine.capture(model, prompt, first_position=5)
        scored, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    assert [layer.length for layer in state.layers] == [4, 4, 4, 20]  # (25 - 5) % 8 entries; the NoPE layer all
    assert (scored - want).abs().max() <= 1e-5
    logps, _ = engine.replay(model, state, prompt[-1:], completions[0], int(lengths[0]))
    assert torch.allclose(logps.detach(), scored[0], atol=1e-6)


@pytest.mark.parametrize(("family", "kind"), [("qwen3", AttentionPages), ("deepseek_v3", LatentPages)])
def test_capture_and_recompute_skip_the_final_layers_attention(monkeypatch, family, kind):
    """The prompt tokens' attention at the final layer feeds nothing a replay or the exact gradient reads (without the
    MoE load-balancing loss): a capture and a recompute keep that layer's state but never attend there; a replay
    attends at every layer."""
    model = prepared(build_model(family, num_hidden_layers=3))
    prompt, completions, lengths = case()
    attended = []
    attend = kind.attend

    def recording(self, access, *args, **kwargs):
        attended.append((access.mode, self.layer_idx))
        return attend(self, access, *args, **kwargs)

    monkeypatch.setattr(kind, "attend", recording)
    engine = LongStrawEngine(8, 4, prompt_gradient="exact")
    state = engine.capture(model, prompt, first_position=0)
    assert all(layer.captured() for layer in state.layers if isinstance(layer, kind))
    logps, _ = engine.replay(model, state.requires_grad_(), prompt[-1:], completions[0], int(lengths[0]))
    logps.sum().backward()
    engine.backward_prompt(model, state, prompt)
    chunks = -(-(prompt.numel() - 1) // 8)
    assert sorted(attended) == sorted(
        [("capture", layer) for layer in (0, 1) for _ in range(chunks)]
        + [("read", layer) for layer in (0, 1, 2)]
        + [("recompute", layer) for layer in (0, 1) for _ in range(chunks)]
    )


def test_capture_and_recompute_skip_the_final_layers_dsa_selection(monkeypatch):
    """The final layer's DSA top-k over the prompt would only feed its skipped attention: a capture and a recompute
    keep its indexer keys but select nothing there; a replay selects at every index-computing layer."""
    from trl_longstraw.state import dsa

    model = prepared(build_model("glm_moe_dsa"))
    prompt, completions, lengths = case()
    selected = []
    select = dsa.IndexerKeys.select

    def recording(self, access, *args, **kwargs):
        selected.append((access.mode, self.layer_idx))
        return select(self, access, *args, **kwargs)

    monkeypatch.setattr(dsa.IndexerKeys, "select", recording)
    engine = LongStrawEngine(8, 4, prompt_gradient="exact")
    state = engine.capture(model, prompt, first_position=0)
    indexers = {layer.layer_idx: layer for layer in state.layers if isinstance(layer, dsa.IndexerKeys)}
    final = model.config.num_hidden_layers - 1
    assert final in indexers and indexers[final].keys.length == prompt.numel() - 1
    logps, _ = engine.replay(model, state.requires_grad_(), prompt[-1:], completions[0], int(lengths[0]))
    logps.sum().backward()
    engine.backward_prompt(model, state, prompt)
    earlier = set(indexers) - {final}
    assert set(selected) == (
        {("capture", i) for i in earlier} | {("read", i) for i in indexers} | {("recompute", i) for i in earlier}
    )


def test_a_model_with_another_attention_implementation_is_refused_before_capture():
    model = build_model("qwen3")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    with pytest.raises(UnpreparedModelError, match="attention implementation is 'sdpa'.*prepare_model"):
        LongStrawEngine(8, 8).capture(model, case()[0], first_position=0)


def test_a_layer_that_bypasses_the_prompt_state_is_refused_after_capture():
    """A mixer whose forward never reaches LongStraw would have its completions scored without the prompt."""
    model = prepared(build_model("qwen3"))
    attention = model.model.layers[1].self_attn
    attention.forward = lambda hidden_states, *args, **kwargs: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnpreparedModelError, match="no prompt state for layer 1 attention"):
        LongStrawEngine(8, 8).capture(model, case()[0], first_position=0)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "deepseek_v3", "glm_moe_dsa"])
def test_activation_checkpointing_replays_from_the_prompt_state(family):
    """Checkpointed decoder layers drop their cache unless told it is read-only: the replay must still read the
    prompt's recurrent states and MLA latents, forward and in the backward's recompute."""
    prompt, completions, lengths = case()
    results = []
    for checkpointing in (False, True):
        model = prepared(build_model(family, seed=0))
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = LongStrawEngine(8, 4)
        state = engine.capture(model, prompt, 0)
        logps, _ = engine.replay(model, state, prompt[-1:], completions[0], int(lengths[0]))
        logps.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), grads))
    (plain_logps, plain_grads), (checkpointed_logps, checkpointed_grads) = results
    assert torch.allclose(checkpointed_logps, plain_logps, atol=1e-6)
    assert plain_grads.keys() == checkpointed_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.allclose(checkpointed_grads[name], grad, atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("value_dim", [16, 24])  # 24: values wider than the keys' no-rope part (the bias splits)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_mla_absorption_keeps_a_kv_b_proj_bias(family, value_dim):
    """The absorbed MLA reads the latents, not per-head K/V: a `kv_b_proj` bias must still reach the values (the
    key bias is a per-query constant the softmax ignores)."""
    model = build_model(family, seed=0, v_head_dim=value_dim)
    for layer in model.model.layers:
        dense = layer.self_attn.kv_b_proj
        biased = torch.nn.Linear(dense.in_features, dense.out_features, bias=True)
        with torch.no_grad():
            biased.weight.copy_(dense.weight)
            biased.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(layer.self_attn.layer_idx))
        layer.self_attn.kv_b_proj = biased
    eager, model = reference_and_prepared(model)
    prompt, completions, lengths = case(prompt_length=20)
    engine = LongStrawEngine(8, 4)
    with torch.no_grad():
        want, _ = full_forward(eager, prompt, completions, lengths)
        scored, _ = engine.score(model, engine.capture(model, prompt, 0), prompt[-1:], completions, lengths, 3)
    assert (scored - want).abs().max() <= 1e-5
