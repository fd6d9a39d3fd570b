"""Ranks of the context-parallel tests (spawned by `tests/test_context_parallel.py`, gloo on CPU).

Each rank computes the single-process reference itself (the plain engine, no collectives), then the same capture,
scoring and replay with the prompt sharded over the group, and saves what the test compares.
"""

import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.context_parallel import (
    COMMUNICATION,
    ContextParallelError,
    ContextParallelGroup,
    check_same_rows,
    distribution_over,
)
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine, prepare_model
from trl_longstraw.groups import PromptGroup
from trl_longstraw.state import AttentionPages, IndexerKeys, LatentPages
from trl_longstraw.state.linear_attention import is_gated_deltanet, state_passing_rule

from .test_engine import chunked_attention_model

PROMPT_LENGTH, COMPLETION_WIDTH = 37, 7
# DSA: top-12 of up to 43 keys, so the selection matters (a per-shard top-k would pick 24); 32 index heads, so that no
# key scores exactly 0 (ReLU) and no tie sits at the boundary.
OVERRIDES = {family: {"index_topk": 12, "index_n_heads": 32} for family in ("deepseek_v32", "glm_moe_dsa")}


def case(seed=0, vocab=100):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, vocab, (PROMPT_LENGTH,), generator=generator)
    completions = torch.randint(2, vocab, (3, COMPLETION_WIDTH), generator=generator)
    weights = torch.randn(3, COMPLETION_WIDTH, generator=generator)
    return prompt, completions, torch.tensor([COMPLETION_WIDTH, 3, 5]), weights


def update(engine, model, prompt, completions, lengths, weights, first_position=2, phase=lambda name: nullcontext()):
    """Capture, score every member, replay each under autograd with a per-token upstream gradient. Under context
    parallelism each rank replays its own members (`members`, a stand-in where it has none) and the gradients are
    summed across the group, as the trainer's reduction does. `phase(name)`: a context for each phase (the fault
    tests' `faults.in_phase`)."""
    model.zero_grad(set_to_none=True)
    with phase("capture"):
        state = engine.capture(model, prompt, first_position=first_position)
        if engine.prompt_gradient == "exact":
            state.requires_grad_()
    with phase("score"), torch.no_grad():
        scored, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    replayed = {}
    with phase("replay"):
        for member in engine.distribution.members(list(range(len(completions)))):
            if member is None:
                engine.stand_in(model, state, prompt[-1:], completions[0])
                continue
            length = int(lengths[member])
            logps, _ = engine.replay(model, state, prompt[-1:], completions[member], length)
            logps.backward(weights[member, :length])
            replayed[member] = logps.detach()
    if engine.prompt_gradient == "exact":
        with phase("prompt_backward"):
            engine.backward_prompt(model, state, prompt)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    if engine.distribution.lockstep:
        grads = summed_over_group(model, grads, engine.distribution.group)
    return state, scored, replayed, grads


def summed_over_group(model, grads, cp):
    """Each rank's gradients summed over the CP group, for every parameter any rank's backward reached."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    reached = torch.tensor([float(name in grads) for name in names])
    cp.all_reduce(reached, op=dist.ReduceOp.MAX)
    summed = {}
    for name, hit in zip(names, reached.tolist(), strict=True):
        if hit:
            grad = grads.get(name)
            summed[name] = cp.all_reduce(
                grad.clone() if grad is not None else torch.zeros_like(model.get_parameter(name))
            )
    return summed


def relative_errors(got, want, floor_fraction):
    floor = floor_fraction * torch.sqrt(sum(w.norm() ** 2 for w in want.values()))
    return {
        k: ((got[k] - want[k]).norm() / torch.maximum(want[k].norm(), floor).clamp(min=1e-30)).item() for k in want
    }


def attention_bytes(state, rolling=False):
    """Bytes of the per-token pages (K/V, MLA latents, DSA indexer keys): what sharding divides; with `rolling`,
    those of the sliding-window layers that keep only their last `window - 1` entries instead."""
    return sum(
        t.numel() * t.element_size()
        for layer in state.layers
        if isinstance(layer, AttentionPages | LatentPages | IndexerKeys)
        and bool(getattr(layer, "rolling", False)) == rolling
        for t in layer.tensors()
    )


def check_family(family, mode, cp, device="cpu"):
    model = build_model(family, seed=0, **OVERRIDES.get(family, {})).to(device)
    if mode == "exact_attention_trained":  # as LoRA on q_proj/v_proj trains: the recurrent layers below are frozen
        mode = "exact"
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(".self_attn." in name)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prompt, completions, lengths, weights = case()
    weights = weights.to(device)  # the engine moves its own inputs; these are the replays' incoming gradients
    reference = LongStrawEngine(8, 4, prompt_gradient=mode)
    sharded = LongStrawEngine(8, 4, prompt_gradient=mode, distribution=distribution_over(cp))
    whole, want_scores, want_logps, want_grads = update(reference, model, prompt, completions, lengths, weights)
    COMMUNICATION.clear()
    rules = [state_passing_rule(module) for module in model.modules() if is_gated_deltanet(module)]
    state, scores, logps, grads = update(sharded, model, prompt, completions, lengths, weights)
    flat = torch.cat([g.reshape(-1) for g in grads.values()]).cpu()
    gathered = [torch.empty_like(flat) for _ in range(cp.size)]
    dist.all_gather(gathered, flat)
    grads, want_grads = ({k: v.cpu() for k, v in g.items()} for g in (grads, want_grads))
    return {
        "communication_device": str(cp.device),
        "score_error": (scores - want_scores).abs().max().item(),
        "replay_error": max(((logps[m] - want_logps[m]).abs().max().item() for m in logps), default=0.0),
        "same_parameters": sorted(grads) == sorted(want_grads),
        "grad_errors": relative_errors(
            grads, want_grads, 1e-3 if family in ("qwen3_5", "qwen3_next", "nemotron_h") else 0.0
        ),
        "rank_difference": max((g - gathered[0]).abs().max().item() for g in gathered),
        "state_bytes": state.nbytes(),
        "whole_state_bytes": whole.nbytes(),
        "attention_bytes": attention_bytes(state),
        "whole_attention_bytes": attention_bytes(whole),
        "window_bytes": attention_bytes(state, rolling=True),
        "whole_window_bytes": attention_bytes(whole, rolling=True),
        "held": state.sharding.layout.held(cp.rank),
        "communication": dict(COMMUNICATION),
        "deferred_starts": sum(rule.deferred_runs for rule in rules),  # GatedDeltaNet rules run by state passing
        "hand_offs": sum(rule.hand_off_runs for rule in rules),  # ... and recomputed so (exact mode)
        "gated_deltanet_layers": len(rules),
    }


def rollouts(engine, model, prompts, rows_per_prompt, config, continuations=None, extended=False):
    """Each prompt captured once, its rows decoded from the state (as the trainer does); tokens and step logits.
    With `continuations`, one row per continuation of the first prompt (a tool turn's rows): fed on top of the
    prompt's state, or with `extended` its state continued with them where they are long enough
    (`LongStrawEngine.extend`: under context parallelism, a continuation spread over the group)."""
    from trl_longstraw.rollout import PromptRows, decode, prepare_sampling

    device = prompts[0].device
    if continuations is None:
        histories = [p for p in prompts for _ in range(rows_per_prompt)]
    else:
        histories = [torch.cat([prompts[0], c]) for c in continuations]
    width = max(len(h) for h in histories)
    padded = torch.stack([torch.cat([h.new_zeros(width - len(h)), h]) for h in histories])
    mask = torch.stack([torch.cat([torch.zeros(width - len(h)), torch.ones(len(h))]).long() for h in histories])
    if continuations is None:
        groups = [
            PromptRows(list(range(i * rows_per_prompt, (i + 1) * rows_per_prompt)), p, engine.capture(model, p, 0))
            for i, p in enumerate(prompts)
        ]
    else:
        state = engine.capture(model, prompts[0], 0)
        groups = [PromptRows([row], prompts[0], state, c) for row, c in enumerate(continuations)]
        if extended:
            fewest = engine.distribution.continuation_tokens
            groups = [
                PromptRows([row], history, engine.extend(model, state, history[len(prompts[0]) - 1 : -1]))
                if len(history) - len(prompts[0]) >= fewest
                else group
                for row, (history, group) in enumerate(zip(histories, groups, strict=True))
            ]
            assert groups[0].state.parent is state  # the long row continued the state (under CP, spread over it)
    sampling = prepare_sampling(model, config, padded, mask.to(device))
    logits = []
    torch.manual_seed(7)
    tokens = decode(engine, model, groups, padded, sampling, logits)
    return tokens.cpu(), torch.stack(logits).cpu()


def check_rollout(family, cp, device="cpu"):
    """Greedy and seeded sampling from the sharded state against the same rollouts from one process's state, and
    rows continuing the first prompt with tokens of their own (a tool turn), their decoded tokens in suffix pages of
    4 (a rank process of its own: the module's page size is this process's)."""
    from transformers import GenerationConfig

    import trl_longstraw.state.suffix

    trl_longstraw.state.suffix.SUFFIX_PAGE_TOKENS = 4

    model = build_model(family, seed=0, **OVERRIDES.get(family, {})).to(device)
    prepare_model(model)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 100, (n,), generator=generator) for n in (PROMPT_LENGTH, PROMPT_LENGTH - 6)]
    prompts = [p.to(device) for p in prompts]
    continuations = [torch.randint(2, 100, (n,), generator=generator).to(device) for n in (19, 1)]
    results = {}
    sampled = {"do_sample": True, "temperature": 0.9, "top_k": 40}
    cases = {"greedy": {"do_sample": False}, "sampled": sampled, "continued": sampled, "extended": sampled}
    for name, settings in cases.items():
        # Token 0 is suppressed: its embedding (padding_idx) is zero, so a DSA indexer query after it scores every key
        # exactly 0, a tie that any two computations of the top-k may break differently.
        config = GenerationConfig(
            max_new_tokens=9, pad_token_id=0, eos_token_id=[1], suppress_tokens=[0], disable_compile=True, **settings
        )
        rows = continuations if name in ("continued", "extended") else None
        want_tokens, want_logits = rollouts(LongStrawEngine(8, 4), model, prompts, 2, config, rows)
        tokens, logits = rollouts(
            LongStrawEngine(8, 4, distribution=distribution_over(cp)), model, prompts, 2, config, rows,
            extended=name == "extended",
        )  # fmt: skip
        results[name] = {
            "same_tokens": torch.equal(tokens, want_tokens),
            "logit_error": (logits - want_logits).abs().max().item(),
        }
    return results


def check_fp8_pages(family, cp):
    """fp8 pages (K/V, MLA latents) under context parallelism: each rank quantises its own shard (its 64-token pages
    start at the shard), so the log-probs agree with one process's fp8 pages to fp8 rounding, not bitwise; returns
    (largest difference to one process's fp8 pages, to its full-precision pages, whether the shard's pages are fp8)."""
    model = build_model(family, seed=0)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prompt, completions, lengths, _ = case()
    scores = {}
    with torch.no_grad():
        for name, engine in {
            "full": LongStrawEngine(8, 4),
            "fp8": LongStrawEngine(8, 4, prompt_state_dtype="float8_e4m3fn"),
            "sharded_fp8": LongStrawEngine(
                8, 4, prompt_state_dtype="float8_e4m3fn", distribution=distribution_over(cp)
            ),
        }.items():
            state = engine.capture(model, prompt, first_position=0)
            scores[name], _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    paged = [t for layer in state.layers if isinstance(layer, AttentionPages | LatentPages) for t in layer.tensors()]
    return (
        (scores["sharded_fp8"] - scores["fp8"]).abs().max().item(),
        (scores["sharded_fp8"] - scores["full"]).abs().max().item(),
        bool(paged) and paged[0].dtype == torch.float8_e4m3fn,
    )


def indexer_communication(cp):
    """Elements the DSA selection sends over one replayed member per rank, and what the formula says: per replayed
    token and index-computing layer, to each other rank, the indexer call's inputs (`hidden + q_lora_rank + 2 *
    rope` for the hidden state, the query residual, cos and sin), the candidates (`2 * k`: scores and key indices)
    and the selection (`k`)."""
    family = "glm_moe_dsa"
    model = build_model(family, seed=0, **OVERRIDES[family])
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prompt, completions, _, _ = case()
    engine = LongStrawEngine(8, 4, distribution=distribution_over(cp))
    state = engine.capture(model, prompt, first_position=0)
    COMMUNICATION.clear()
    with torch.no_grad():
        engine.replay(model, state, prompt[-1:], completions[cp.rank], COMPLETION_WIDTH)
    tokens = COMPLETION_WIDTH + 1  # the last prompt token, then the completion
    config = model.config
    layers = sum(indexer == "full" for indexer in config.indexer_types)
    per_token = (
        config.hidden_size + config.q_lora_rank + 2 * config.qk_rope_head_dim + 3 * OVERRIDES[family]["index_topk"]
    )
    return COMMUNICATION["indexer"], layers * tokens * (cp.size - 1) * per_token


def refusal(cp, family="qwen3", prompt_length=2, model=None):
    """The error a capture raises (before any collective, on every rank), or None."""
    model = build_model(family, seed=0) if model is None else model
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    try:
        LongStrawEngine(8, 4, distribution=distribution_over(cp)).capture(model, torch.arange(5, 5 + prompt_length), 0)
    except ContextParallelError as error:
        return str(error)
    return None


def different_histories(cp):
    """`check_same_rows` on rows every rank has (passes), then on rows that differ by rank: the error, or None."""
    check_same_rows([[5, 6, 7], [5, 6]], cp)
    try:
        check_same_rows([[5, 6, 7 + cp.rank]], cp)
    except ContextParallelError as error:
        return str(error)
    return None


# Rollouts from a sharded state: dense, GatedDeltaNet hybrid, MLA + DSA (top-12), sliding window + sinks.
ROLLOUT_FAMILIES = ("qwen3", "qwen3_5", "glm_moe_dsa", "gpt_oss")


def run(rank, world_size, init_file, cases, out_dir):
    # a rank left waiting for a peer (a hand-off nobody receives) fails the run instead of hanging it
    timeout = timedelta(seconds=120)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        cp = ContextParallelGroup.of()
        results = {(family, mode): check_family(family, mode, cp) for family, mode in cases}
        results["rollouts"] = {family: check_rollout(family, cp) for family in ROLLOUT_FAMILIES}
        results["indexer_communication"] = indexer_communication(cp)
        results["fp8"] = {family: check_fp8_pages(family, cp) for family in ("qwen3", "deepseek_v3")}
        results["short_prompt"] = refusal(cp)
        results["different_histories"] = different_histories(cp)
        results["chunked"] = refusal(cp, prompt_length=PROMPT_LENGTH, model=chunked_attention_model())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_device(rank, world_size, init_file, cases, rollout_families, out_dir, device="cuda"):
    """The same checks with the models on one device shared by the ranks (CUDA: a one-GPU machine) and gloo: the
    collectives' tensors cross between the device and the host (`ContextParallelGroup`), fp32 without TF32."""
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cp = ContextParallelGroup.of()
        results = {(family, mode): check_family(family, mode, cp, device) for family, mode in cases}
        results["rollouts"] = {family: check_rollout(family, cp, device) for family in rollout_families}
        torch.save(results, os.path.join(out_dir, f"{device}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_data_and_context_parallel(rank, world_size, init_file, mode, out_dir):
    """dp = 2 x cp = 2: each CP group updates on its own prompt, then gradients are averaged over the world (as the
    trainer does); every rank must end with the mean of the two prompts' single-process gradients."""
    from trl_longstraw.context_parallel import build_context_parallel_group
    from trl_longstraw.distributed import average_gradients

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        context = build_context_parallel_group(2)
        model = build_model("qwen3", seed=0)
        prepare_model(model)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        cases = [case(seed) for seed in (0, 1)]
        reference = LongStrawEngine(8, 4, prompt_gradient=mode)
        wanted = [update(reference, model, *c)[3] for c in cases]
        want = {name: (wanted[0][name] + wanted[1][name]) / 2 for name in wanted[0]}
        sharded = LongStrawEngine(8, 4, prompt_gradient=mode, distribution=distribution_over(context))
        update(sharded, model, *cases[rank // 2])  # CP group k = ranks 2k, 2k + 1 takes prompt k
        params = [p for p in model.parameters() if p.grad is not None]
        average_gradients(params, shares=2)
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        result = {
            "context_ranks": dist.get_process_group_ranks(context.group),
            "grad_errors": relative_errors(grads, want, 0.0),
            "rank_difference": max((g - gathered[0]).abs().max().item() for g in gathered),
        }
        torch.save(result, os.path.join(out_dir, f"dpcp-{mode}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def group_update(engine, model, prompt, completions, lengths, grad_logps, grad_entropies):
    """The trainer's calls for one group: capture, `score_group` (which spreads a member longer than
    `replay_segment_size`, and the spans members share, over the CP group: `ContextParallel.in_steps`, `capture_span`),
    `update_group` (replay, and exact mode's prompt backward); the scores and the gradients summed over the group."""
    model.zero_grad(set_to_none=True)
    group = PromptGroup(0, list(range(len(lengths))), prompt, 2, list(lengths))
    with torch.no_grad():
        state = engine.capture(model, prompt, first_position=2)
        scores = engine.score_group(model, state, group, completions)
    engine.update_group(model, state, group, completions, grad_logps, grad_entropies)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    if engine.distribution.lockstep:
        grads = summed_over_group(model, grads, engine.distribution.group)
    return scores.logps, scores.entropies, grads


def tree_case():
    """`tests/test_segments.py`'s tree members: spans of 6 and 4 tokens shared by 4 and 3 of 5 members (members 0 and
    4 alike to the end, whose last span a CP group of 2 leaves to each: it keeps 4 tokens per member), one sharing
    nothing; float64 gradients."""
    from .test_segments import tree_members

    prompt, completions, lengths, grad_logps, grad_entropies = tree_members()
    return prompt, completions, lengths, grad_logps, grad_entropies


def float64_model(family):
    model = build_model(family, seed=0, dtype=torch.float64, **OVERRIDES.get(family, {}))
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


# The CP engine's settings against one process replaying every member whole and alone: members longer than 3 tokens
# in segments (the long ones spread over the group in steps); spans of 4 tokens or more shared, whole and in segments.
CONTINUATION_SETTINGS = {
    "segments": {"replay_segment_size": 3, "shared_span_tokens": None},
    "tree": {"replay_segment_size": None, "shared_span_tokens": 4},
    "tree_segments": {"replay_segment_size": 3, "shared_span_tokens": 4},
}


def check_continuations(family, mode, settings, cp):
    """A group whose long members (and the spans members share) the CP group runs together, spread over it as the
    prompt's chunks are, against one process replaying every member whole: scores, entropies, every gradient."""
    model = float64_model(family)
    if settings == "segments":
        prompt, completions, lengths, grad_logps = case()
        grad_logps = grad_logps.double()
        grad_entropies, lengths = grad_logps.flip(0), lengths.tolist()
    else:
        prompt, completions, lengths, grad_logps, grad_entropies = tree_case()
    args = (model, prompt, completions, lengths, grad_logps, grad_entropies)
    whole = LongStrawEngine(8, 4, prompt_gradient=mode, shared_span_tokens=None)
    sharded = LongStrawEngine(
        8, 4, prompt_gradient=mode, distribution=distribution_over(cp), **CONTINUATION_SETTINGS[settings]
    )
    want_scores, want_entropies, want_grads = group_update(whole, *args)
    scores, entropies, grads = group_update(sharded, *args)
    floor = 1e-3 if family in ("qwen3_5", "qwen3_next", "nemotron_h") else 0.0
    return {
        "score_error": (scores - want_scores).abs().max().item(),
        "entropy_error": (entropies - want_entropies).abs().max().item(),
        "same_parameters": sorted(grads) == sorted(want_grads),
        "grad_errors": relative_errors(grads, want_grads, floor),
        "spans": spans(sharded.shared_spans(completions, lengths)),
    }


def spans(nodes) -> list[tuple[int, int, list[int]]]:
    """Every span of a prefix tree, `(start, end, members)`, depth first."""
    return [span for node in nodes for span in [(node.start, node.end, node.members), *spans(node.children)]]


def dropped_states_are_freed(cp) -> bool:
    """Whether a captured prompt state and a continuation of it, spread over the CP group, are freed the moment the
    last reference to them goes, without the garbage collector (a state and its sharding must not form a cycle, which
    would keep a prompt's pages alive beside the next prompt's until a collection)."""
    import gc
    import weakref

    model = float64_model("qwen3_5")
    prompt = case()[0]
    engine = LongStrawEngine(8, 4, distribution=distribution_over(cp))
    gc.collect()
    gc.disable()
    try:
        state = engine.capture(model, prompt, first_position=0)
        continued = engine.extend(model, state, prompt[:12])
        refs = [weakref.ref(state), weakref.ref(continued)]
        del state, continued
        return all(ref() is None for ref in refs)
    finally:
        gc.enable()


def run_continuations(rank, world_size, init_file, cases, out_dir):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        cp = ContextParallelGroup.of()
        results = {case: check_continuations(*case, cp) for case in cases}
        results["freed"] = dropped_states_are_freed(cp)
        torch.save(results, os.path.join(out_dir, f"continuations-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
