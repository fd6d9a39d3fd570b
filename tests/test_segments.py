"""Long members in segments (`replay_segment_size`): each segment's state captured into a continuation of the prompt
state, the later segments' gradient carried back into it exactly. Scores and gradients against a whole replay, against
one full forward per member (stock's path), and the whole update against the references."""

import itertools

import pytest
import torch
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOConfig
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.groups import PromptGroup
from trl_longstraw.load_balancing import moe_routing
from trl_longstraw.segments import prefix_tree
from trl_longstraw.state import PromptState

from .conftest import max_relative_error
from .reference import AGAINST_THE_REFERENCE, LOSS_TYPES, assert_matches_the_reference, run_pair
from .test_engine import chunked_attention_model, prepared

# A family per state kind and attention feature: GQA pages, a sliding window, GatedDeltaNet + attention, Mamba2 +
# attention, MLA + DSA + MoE, attention sinks, logit soft-capping, Llama 4's chunked attention (its chunks of 8 span
# segment boundaries).
FAMILIES = ["qwen3", "mistral", "qwen3_5", "nemotron_h", "deepseek_v32", "gpt_oss", "gemma2", "llama4_text"]
# Members of 11, 4 and 9 tokens (12, 5 and 10 replayed) in segments of 3: four segments, two, and three whose last
# one takes the one token that would be left at the end.
LENGTHS = [11, 4, 9]
SEGMENT = 3


def model_of(family, dtype=torch.float64):
    model = chunked_attention_model(8).to(dtype) if family == "llama4_text" else build_model(family, dtype=dtype)
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


def members(dtype=torch.float64):
    """A prompt, members of `LENGTHS` tokens, and the loss's gradients of their log-probs and entropies."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 90, (21,), generator=generator)
    completions = torch.randint(2, 90, (len(LENGTHS), max(LENGTHS)), generator=generator)
    grad_logps = torch.randn(completions.shape, generator=generator, dtype=dtype)
    grad_entropies = torch.randn(completions.shape, generator=generator, dtype=dtype)
    return prompt, completions, LENGTHS, grad_logps, grad_entropies


def engine_update(family, prompt_gradient, segment_size, checkpointing=None):
    """Scores, then `sum(grad_logps * logps + grad_entropies * entropies)` back-propagated through the engine; with
    `checkpointing` ("reentrant" or "non-reentrant"), the decoder layers activation-checkpointed so."""
    model = prepared(model_of(family))
    if checkpointing is not None:
        model.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        model.train()
    prompt, completions, _, grad_logps, grad_entropies = members()
    engine = LongStrawEngine(
        prefill_chunk_size=8,
        attention_chunk_size=5,
        prompt_gradient=prompt_gradient,
        replay_segment_size=segment_size,
    )
    state = engine.capture(model, prompt, 0)
    with torch.no_grad():
        logps, entropies = engine.score(model, state, prompt[-1:], completions, torch.tensor(LENGTHS), batch_size=1)
    if prompt_gradient == "exact":
        state.requires_grad_()
    engine.replay_group(model, state, prompt[-1:], completions, LENGTHS, grad_logps, grad_entropies)
    if prompt_gradient == "exact":
        engine.backward_prompt(model, state, prompt)
    return logps, entropies, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def stock_gradients(family, group=members):
    """One full forward of prompt + completion per member of `group()`, under autograd: stock GRPOTrainer's path."""
    model = model_of(family)
    model.set_attn_implementation("eager")
    model = prepared(model)
    model.set_attn_implementation("eager")
    prompt, completions, lengths, grad_logps, grad_entropies = group()
    for row, length in enumerate(lengths):
        ids = torch.cat([prompt, completions[row, :length]])[None]
        labels = ids.masked_fill(torch.arange(ids.shape[1]) < prompt.numel(), -100)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        objective = (out.log_probs[0, -length:] * grad_logps[row, :length]).sum()
        objective = objective + (out.entropy[0, -length:] * grad_entropies[row, :length]).sum()
        objective.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def global_relative_error(got, want):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    difference = sum(((got[name] - want[name]) ** 2).sum() for name in want).sqrt()
    return (difference / sum((w**2).sum() for w in want.values()).sqrt()).item()


@pytest.mark.parametrize("size", [2, 3, 5, 16])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 9, 15, 16])
def test_segments_cover_the_replay_in_order(length, size):
    segments = LongStrawEngine(8, 8, replay_segment_size=size).member_segments(length)
    replayed = max(length, 1) + 1
    assert segments[0][0] == 0 and segments[-1][1] == replayed
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(segments))
    assert all(2 <= end - start <= size for start, end in segments[:-1])
    assert 2 <= segments[-1][1] - segments[-1][0] <= size + 1 or len(segments) == 1
    assert len(segments) == max(1, -(-(replayed - 1) // size))


def test_no_segment_size_replays_every_member_whole():
    assert LongStrawEngine(8, 8).member_segments(100_000) == [(0, 100_001)]


@pytest.mark.parametrize("family", FAMILIES)
def test_segmented_scores_equal_whole_scores(family):
    whole_logps, whole_entropies, _ = engine_update(family, "detach", None)
    logps, entropies, _ = engine_update(family, "detach", SEGMENT)
    assert torch.allclose(logps, whole_logps, rtol=0, atol=1e-6)
    assert torch.allclose(entropies, whole_entropies, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_segmented_exact_replay_gives_stock_gradients(family):
    # TRL's fused LM head accumulates in fp32 on both sides, which bounds float64 agreement near 1e-7 (measured
    # 1.1e-7 to 1.4e-7 with segments and 0.9e-7 to 1.2e-7 whole; without the gradient carried back into the
    # segments' own entries, 9e-2).
    _, _, grads = engine_update(family, "exact", SEGMENT)
    assert global_relative_error(grads, stock_gradients(family)) <= 1e-6


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v32"])
def test_segmented_replay_under_activation_checkpointing_gives_stock_gradients(family, checkpointing):
    """Segments run checkpointed as the layers are (the entries a segment records keep their graph); reentrant
    checkpointing, which would run them without one, is turned off for the segments."""
    _, _, grads = engine_update(family, "exact", SEGMENT, checkpointing)
    assert global_relative_error(grads, stock_gradients(family)) <= 1e-6


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v32"])
def test_segments_continue_a_prompt_state_of_fp8_pages(family):
    """fp8 prompt pages (detach mode) dequantised as read beside a member's own entries in the model's dtype: the
    scores and gradients of a whole replay from the same fp8 state."""
    results = []
    for size in (None, SEGMENT):
        model = prepared(model_of(family, torch.float32))
        prompt, completions, lengths, grad_logps, grad_entropies = members(torch.float32)
        engine = LongStrawEngine(8, 5, prompt_state_dtype="float8_e4m3fn", replay_segment_size=size)
        state = engine.capture(model, prompt, 0)
        with torch.no_grad():
            logps, _ = engine.score(model, state, prompt[-1:], completions, torch.tensor(lengths), batch_size=1)
        engine.replay_group(model, state, prompt[-1:], completions, lengths, grad_logps, grad_entropies)
        results.append((logps, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (whole_logps, whole), (logps, grads) = results
    assert torch.allclose(logps, whole_logps, rtol=0, atol=1e-5)
    assert global_relative_error(grads, whole) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_segmented_detach_replay_gives_the_whole_replays_gradients(family):
    """Detach holds the prompt constant, never the member's own earlier tokens: their gradient is carried back."""
    _, _, whole = engine_update(family, "detach", None)
    _, _, grads = engine_update(family, "detach", SEGMENT)
    assert global_relative_error(grads, whole) <= 1e-6


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@AGAINST_THE_REFERENCE
def test_segmented_update_matches_the_reference(
    prompt_gradient, reference_class, loss_type, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    """The trainer's update with segments of 2 tokens (members of 1 to 9 tokens: one to five segments)."""
    ref_loss, loss, ref_grads, grads = run_pair(
        reference_class,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        loss_type=loss_type,
        beta=0.04,
        prompt_gradient=prompt_gradient,
        replay_segment_size=2,
        batch_shape={"completion_lengths": ((9, 3, 5), (2, 8, 1))},
    )
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_moe"])
@AGAINST_THE_REFERENCE
def test_segmented_hybrid_and_moe_updates_match_the_reference(
    prompt_gradient, reference_class, model_type, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    """GatedDeltaNet state handed from segment to segment; the MoE load-balancing loss summed over segments."""
    moe = {"router_aux_loss_coef": 0.5} if model_type == "qwen3_moe" else {}
    ref_loss, loss, ref_grads, grads = run_pair(
        reference_class,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        model_type=model_type,
        prompt_gradient=prompt_gradient,
        beta=0.04,
        replay_segment_size=3,
        batch_shape={"completion_lengths": ((9, 3, 5), (2, 8, 1))},
        **moe,
    )
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads, floor_fraction=1e-3)


def test_float64_segmented_update_matches_stock(fresh_model, tokenizer, prompt_dataset, tmp_path):
    ref_loss, loss, ref_grads, grads = run_pair(
        GRPOTrainer,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        dtype=torch.float64,
        beta=0.04,
        prompt_gradient="exact",
        replay_segment_size=2,
        batch_shape={"completion_lengths": ((9, 3, 5), (2, 8, 1))},
    )
    assert torch.allclose(loss, ref_loss, rtol=1e-7)
    assert max_relative_error(grads, ref_grads) <= 1e-6


@pytest.mark.parametrize("size", [1, 0, -4])
def test_a_segment_shorter_than_two_tokens_is_refused(size, tmp_path):
    with pytest.raises(ValueError, match=rf"replay_segment_size={size} must be at least 2"):
        LongStrawGRPOConfig(output_dir=str(tmp_path), replay_segment_size=size, report_to="none", use_cpu=True)


def test_a_segment_size_that_is_not_an_integer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="replay_segment_size='4096' must be a positive integer"):
        LongStrawGRPOConfig(output_dir=str(tmp_path), replay_segment_size="4096", report_to="none", use_cpu=True)


def test_the_trainer_replays_long_members_in_segments(monkeypatch, fresh_model, tokenizer, prompt_dataset, tmp_path):
    """Members of 9, 8 and 5 tokens with segments of 3 (10, 9 and 6 replayed: 3, 3 and 2 segments; the members of 3
    tokens or fewer fit in one): each scored (the loss's log-probs, no grad) and replayed from a continuation of its
    group's prompt state holding all but its last segment."""

    continued = []
    continuation = PromptState.continuation

    def recorded(self, num_tokens):
        continued.append(num_tokens)
        return continuation(self, num_tokens)

    monkeypatch.setattr(PromptState, "continuation", recorded)
    run_pair(
        GRPOTrainer,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        beta=0.04,
        prompt_gradient="exact",
        replay_segment_size=3,
        batch_shape={"completion_lengths": ((9, 3, 5), (2, 8, 1))},
    )
    assert sorted(continued) == [3, 3, 6, 6, 6, 6]


# ---------------------------------------------------------------------------------------------------------------------
# Members that share more than the prompt: a prefix tree of spans, each run once
# ---------------------------------------------------------------------------------------------------------------------
def tree_members(dtype=torch.float64):
    """Five members whose completions share spans three deep: members 0 and 4 alike (A B C), member 1 (A B D),
    member 2 (A E), member 3 (F) sharing nothing."""
    generator = torch.Generator().manual_seed(2)
    part = lambda n: torch.randint(2, 90, (n,), generator=generator)
    a, b, c, d, e, f = part(6), part(4), part(4), part(3), part(5), part(8)
    rows = [torch.cat(x) for x in ([a, b, c], [a, b, d], [a, e], [f], [a, b, c])]
    lengths = [len(row) for row in rows]
    completions = torch.stack([torch.nn.functional.pad(row, (0, max(lengths) - len(row))) for row in rows])
    prompt = part(21)
    grad_logps = torch.randn(completions.shape, generator=generator, dtype=dtype)
    grad_entropies = torch.randn(completions.shape, generator=generator, dtype=dtype)
    return prompt, completions, lengths, grad_logps, grad_entropies


def test_the_prefix_tree_of_the_tree_members():
    _, completions, lengths, _, _ = tree_members()
    labels = [completions[i, :n].tolist() + [-100] for i, n in enumerate(lengths)]
    [root] = prefix_tree(labels, 2)
    assert (root.start, root.end, root.members, root.leaves) == (0, 6, [0, 1, 2, 4], [2])
    [middle] = root.children
    assert (middle.start, middle.end, middle.members, middle.leaves) == (6, 10, [0, 1, 4], [1])
    [deepest] = middle.children
    # members 0 and 4 are alike to the end: the span stops two tokens before it, which each feeds on its own
    assert (deepest.start, deepest.end, deepest.members, deepest.leaves, deepest.children) == (
        10,
        13,
        [0, 4],
        [0, 4],
        [],
    )
    # spans of 10 tokens or more: members 0, 1 and 4 share A B, from the first token
    assert [(n.start, n.end, n.members, n.children) for n in prefix_tree(labels, 10)] == [(0, 10, [0, 1, 4], [])]
    assert prefix_tree(labels, 14) == []  # members 0 and 4 share 13 tokens before their last two
    assert LongStrawEngine(8, 8).shared_spans(completions, [0] * 5) == []


@pytest.mark.parametrize(
    "labels, min_tokens, spans",
    [
        ([[1, 2, 3, 4, -100], [5, 2, 3, 4, -100]], 2, []),  # they part at the first token
        ([[1, 2, 3, 4, -100], [1, 2, 3, 9, 9, -100]], 2, [(0, 3, [0, 1])]),
        ([[1, 2, 3, -100], [1, 2, 3, 4, -100]], 2, [(0, 2, [0, 1])]),  # two tokens before the shorter one's end
        ([[1, 2, -100], [1, 2, -100], [1, 2, -100]], 2, []),  # alike, but nothing left to share
        ([[1, 2, 3, 4, -100], [1, 2, 3, 4, -100], [7, 7, 7, -100]], 2, [(0, 3, [0, 1])]),
        ([[1, 2, 3, 4, 5, -100], [1, 2, 8, 8, 8, -100], [1, 2, 8, 8, 9, -100]], 3, [(0, 4, [1, 2])]),
        ([[], [1, 2, 3, 4, -100]], 2, []),  # an empty member shares nothing
    ],
)
def test_shared_spans_are_found_from_the_labels(labels, min_tokens, spans):
    found = prefix_tree(labels, min_tokens)
    assert [(node.start, node.end, node.members) for node in found] == spans


def tree_update(family, prompt_gradient, segment_size, share: bool, monkeypatch, routed=False):
    """The tree members' update through the engine, their shared spans run once (`share`) or each member alone; with
    `routed`, the MoE load-balancing loss's gradient too (random weights per expert)."""
    model = prepared(model_of(family))
    prompt, completions, lengths, grad_logps, grad_entropies = tree_members()
    routing = moe_routing(model) if routed else None
    engine = LongStrawEngine(
        8,
        5,
        prompt_gradient=prompt_gradient,
        replay_segment_size=segment_size,
        routing=routing,
        shared_span_tokens=2 if share else None,
    )
    router_weights = None
    if routed:
        router_weights = torch.randn(routing.num_experts, generator=torch.Generator().manual_seed(3)).double()
    state = engine.capture(model, prompt, 0)
    if prompt_gradient == "exact":
        state.requires_grad_()
    continued = []
    continuation = PromptState.continuation
    monkeypatch.setattr(PromptState, "continuation", lambda self, n: continued.append(n) or continuation(self, n))
    replayed = engine.replay_group(
        model, state, prompt[-1:], completions, lengths, grad_logps, grad_entropies, router_weights
    )
    if prompt_gradient == "exact":
        engine.backward_prompt(model, state, prompt, None if router_weights is None else router_weights * 5)
    assert replayed.members == [0, 1, 2, 3, 4] and bool(replayed.finite.all())
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return grads, continued


@pytest.mark.parametrize("segment_size", [None, 3])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "nemotron_h", "deepseek_v32"])
def test_a_tree_of_shared_spans_gives_stock_gradients(family, segment_size, monkeypatch):
    """Spans of 6, 4 and 3 tokens run once for 4, 3 and 2 members (each a continuation of the one above), in segments
    of 3 or whole; the members' own tokens from them."""
    grads, continued = tree_update(family, "exact", segment_size, True, monkeypatch)
    assert sorted(continued)[-3:] == [3, 4, 6] if segment_size is None else 6 in continued
    assert global_relative_error(grads, stock_gradients(family, tree_members)) <= 1e-6


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v32"])
def test_a_tree_of_shared_spans_in_detach_mode_gives_each_members_own_replays_gradients(family, monkeypatch):
    """Detach holds the prompt constant, never the spans members share: their gradient is every member's."""
    shared, _ = tree_update(family, "detach", None, True, monkeypatch)
    alone, continued = tree_update(family, "detach", None, False, monkeypatch)
    assert continued == []
    assert global_relative_error(shared, alone) <= 1e-6


def test_a_tree_counts_each_members_routing_of_a_shared_span(monkeypatch):
    """The load-balancing loss reads every row's tokens: a span shared by k members is routed once and counts k
    times, as each member's own replay counts it."""
    shared, continued = tree_update("qwen3_moe", "exact", None, True, monkeypatch, routed=True)
    alone, _ = tree_update("qwen3_moe", "exact", None, False, monkeypatch, routed=True)
    assert continued
    assert global_relative_error(shared, alone) <= 1e-6


@pytest.mark.parametrize("segment_size", [None, 3])
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v32", "qwen3_moe"])
def test_a_tree_scores_every_member_as_it_scores_alone(family, segment_size):
    """Spans scored once for the members below them, each member's own tokens from its deepest span: the scores, the
    entropies and (MoE) the rows' router load equal each member's own scoring."""
    model = prepared(model_of(family))
    prompt, completions, lengths, _, _ = tree_members()
    routing = moe_routing(model) if family == "qwen3_moe" else None
    group = PromptGroup(0, list(range(len(lengths))), prompt, 0, lengths)
    scores = []
    for share in (2, None):
        engine = LongStrawEngine(8, 5, replay_segment_size=segment_size, routing=routing, shared_span_tokens=share)
        state = engine.capture(model, prompt, 0)
        with torch.no_grad():
            scores.append(engine.score_group(model, state, group, completions, router_load=routing is not None))
    shared, alone = scores
    assert torch.allclose(shared.logps, alone.logps, rtol=0, atol=1e-6)
    assert torch.allclose(shared.entropies, alone.entropies, rtol=0, atol=1e-6)
    if routing is not None:
        assert torch.allclose(shared.router_load.probs, alone.router_load.probs, rtol=1e-9)
        assert torch.equal(shared.router_load.counts, alone.router_load.counts)
        assert shared.router_load.rows == alone.router_load.rows
