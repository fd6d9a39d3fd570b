"""Every family of the support table through the verification ladder, both gradient modes (tiny configs, fp32).

Level 2: completion log-probs from capture + replay equal one full forward of prompt + completion under the model's
own eager attention (which implements sinks and soft-capping), at several capture/attention chunkings.
Level 6: replays reproduce the scores and leave the captured state bitwise unchanged.
Levels 3 and 4: `replay_and_backward` against stock `GRPOTrainer.compute_loss().backward()` (exact mode) and against
the detached reference (detach mode): same loss, same gradients.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.embedded import FAMILIES, build_model
from trl_longstraw.engine import LongStrawEngine, prepare_model
from trl_longstraw.state import ConvRecurrentState

from .reference import AGAINST_THE_REFERENCE, assert_matches_the_reference, run_pair
from .test_engine import case, full_forward, reference_and_prepared

# Recurrent families: the gradients of A_log / dt_bias (and Mamba's D) are tiny sums with heavy cancellation, which
# two exact orderings of the same math disagree on far above rounding: compare them against 1e-3 of the global norm.
RECURRENT = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h"}
# OPT's key bias: its gradient is zero in exact arithmetic (the softmax ignores a shift common to a query's scores),
# so both sides hold rounding noise near 1e-10: compare it against 1e-5 of the global norm.
KEY_BIAS = {"opt"}
DSA = {"deepseek_v32", "glm_moe_dsa"}


def with_fused_head(model):
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def eager_and_prepared(family, **overrides):
    return reference_and_prepared(build_model(family, **overrides))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prefill_chunk, attention_chunk", [(1000, 1000), (4, 3)])
def test_level2_scores_equal_a_full_eager_forward(family, prefill_chunk, attention_chunk):
    eager, model = eager_and_prepared(family)
    prompt, completions, lengths = case()
    engine = LongStrawEngine(prefill_chunk, attention_chunk)
    with torch.no_grad():
        want, want_entropies = full_forward(eager, prompt, completions, lengths, offset=5)
        state = engine.capture(model, prompt, first_position=5)
        logps, entropies = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=2)
    assert (logps - want).abs().max() <= 1e-5
    assert torch.all(logps[1, 3:] == 0) and torch.all(logps[2, 5:] == 0)
    real = torch.arange(completions.shape[1])[None, :] < lengths[:, None]
    assert ((entropies - want_entropies) * real).abs().max() <= 1e-5


def sparse_dsa_error(family, before_scoring=lambda model: None, prompt_length=29):
    """Largest |log-prob difference| between capture + score (chunks of 7, key blocks of 5) and one full eager
    forward, at top-12 of up to `prompt_length + 7` keys: 32 index heads, so that no key scores exactly 0 (ReLU) and
    no tie sits at the selection boundary. `before_scoring(model)` runs between building the models and the scoring."""
    eager, model = eager_and_prepared(family, index_topk=12, index_n_heads=32)
    before_scoring(model)
    prompt, completions, lengths = case(prompt_length=prompt_length)
    engine = LongStrawEngine(7, 5)
    with torch.no_grad():
        want, _ = full_forward(eager, prompt, completions, lengths, offset=0)
        logps, _ = engine.score(model, engine.capture(model, prompt, 0), prompt[-1:], completions, lengths, 1)
    return (logps - want).abs().max()


@pytest.mark.parametrize("family", sorted(DSA))
def test_level2_sparse_dsa_selection(family):
    assert sparse_dsa_error(family) <= 1e-5


@pytest.mark.parametrize("family", sorted(DSA))
def test_dsa_indexer_calls_stay_within_one_chunks_scores_and_rerun_the_query_side_rarely(family, monkeypatch):
    """An indexer call over the prompt's keys never scores more (row, key) pairs than all its call's rows against
    `attention_chunk_size` keys, but it takes wider key blocks with fewer rows, so the indexer's query side reruns
    less often than once per `attention_chunk_size` keys; the model's own call scores its own keys only; and the
    selection still equals one full eager forward's (top-12 of up to 87 keys)."""
    from trl_longstraw.state import dsa

    calls, own = [], []
    visit_block, select = dsa.block_candidates, dsa.IndexerKeys.select

    def recording_block(indexer, call, keys, key_index, k):
        calls.append((call["hidden_states"].shape[1], keys.shape[1]))
        return visit_block(indexer, call, keys, key_index, k)

    def recording_select(self, access, call, own_scores, own_index, k):
        own.append((own_scores.shape[-1], call["hidden_states"].shape[1], access.prefix_length))
        return select(self, access, call, own_scores, own_index, k)

    monkeypatch.setattr(dsa, "block_candidates", recording_block)
    monkeypatch.setattr(dsa.IndexerKeys, "select", recording_select)
    assert sparse_dsa_error(family, prompt_length=80) <= 1e-5
    assert all(columns == tokens for columns, tokens, _ in own)  # the model's own call: its own keys only
    widest = max(tokens for _, tokens, _ in own) * 5
    assert all(rows * keys <= widest for rows, keys in calls)
    assert max(keys for _, keys in calls) == 40 and len(calls) > len(own)  # key blocks of 8 x 5, several per call
    query_side_rows = sum(rows for rows, _ in calls)
    once_per_chunk_of_keys = sum(tokens * -(-prefix // 5) for _, tokens, prefix in own)
    assert query_side_rows * 4 < once_per_chunk_of_keys


def test_an_interrupted_dsa_selection_leaves_later_topk_calls_alone(monkeypatch):
    """A KeyboardInterrupt inside the indexer skips the hook that leaves the selection mode; the stale mode must let
    every later `topk` through, and the next capture must select as usual."""
    from trl_longstraw.state import dsa

    visit_block = dsa.block_candidates
    modes = torch._C._len_torch_function_stack()

    def interrupted(*args):
        raise KeyboardInterrupt

    def interrupt_a_capture(model):
        monkeypatch.setattr(dsa, "block_candidates", interrupted)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            LongStrawEngine(7, 5).capture(model, case()[0], 0)
        monkeypatch.setattr(dsa, "block_candidates", visit_block)
        assert torch._C._len_torch_function_stack() == modes + 1  # the stale mode, inert
        scores = torch.randn(3, 5, 9)
        assert torch.equal(torch.topk(scores, 2).indices, scores.sort(-1, descending=True).indices[..., :2])

    assert sparse_dsa_error("glm_moe_dsa", interrupt_a_capture) <= 1e-5
    assert torch._C._len_torch_function_stack() == modes  # the next indexer call left it


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_level6_replay_reproduces_scores_and_leaves_the_state_unchanged(family, prompt_gradient):
    model = with_fused_head(prepare_model(build_model(family)))
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
    if prompt_gradient == "exact":  # every state the replays read received its gradient
        for layer in state.layers:
            if isinstance(layer, ConvRecurrentState):
                read = [layer.conv[-1], layer.recurrent[-1]]
            else:
                read = layer.tensors() if layer.differentiable else []
            assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in read), (layer.layer_idx, type(layer))


@pytest.mark.parametrize("family", list(FAMILIES))
@AGAINST_THE_REFERENCE
def test_levels3_4_loss_and_gradients_match_the_reference(
    family, prompt_gradient, reference_class, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    ref_loss, loss, ref_grads, grads = run_pair(
        reference_class,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        model_type=family,
        loss_type="dapo",
        beta=0.04,
        prompt_gradient=prompt_gradient,
    )
    floor_fraction = 1e-3 if family in RECURRENT else 1e-5 if family in KEY_BIAS else 0.0
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads, floor_fraction=floor_fraction)


def test_reference_models_load_with_an_attention_that_implements_their_features(tmp_path):
    """Stock's side of levels 3/4 must be right too: SDPA has no sinks or soft-capping, so those families' default
    attention (what from_pretrained picks, what stock GRPOTrainer runs) must be eager."""
    for family in ("gpt_oss", "gemma2"):
        build_model(family).save_pretrained(tmp_path / family)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / family)
        assert loaded.config._attn_implementation == "eager", family


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2", "qwen3", "mistral"])
def test_forwards_without_prompt_state_run_as_stock(family):
    """Generation runs the registered attention without a state: SDPA, or the model's own eager attention where SDPA
    cannot express the family (sinks, soft-capping); both give the eager model's log-probs."""
    eager, model = eager_and_prepared(family)
    prompt, completions, lengths = case()
    with torch.no_grad():
        want, _ = full_forward(eager, prompt, completions, lengths, offset=2)
        got, _ = full_forward(model, prompt, completions, lengths, offset=2)
    assert (got - want).abs().max() <= 1e-5


def test_a_sliding_window_mla_layer_reads_only_its_window():
    # Dots 3 Note's sliding layers are MLA layers with a window (6 in the tiny config; the prompt is 29 tokens).
    from .conformance import level2_error, tiny_config

    config = tiny_config("dots3_note_text")
    assert "sliding_attention" in config.layer_types and config.sliding_window < 29
    torch.manual_seed(0)
    assert level2_error(AutoModelForCausalLM.from_config(config)) < 1e-5
