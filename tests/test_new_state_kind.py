"""Adding a state kind is one file and one registration: a toy token mixer whose state is a running sum, defined in
this file alone, goes through capture, scoring, replay in both gradient modes, decoding and 2-rank context
parallelism, against references that never touch LongStraw's state. And a kind that leaves a duty out is refused when
it is registered, naming the duty."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import DynamicCache, GenerationConfig

from trl_longstraw.accounting import prompt_state_bytes
from trl_longstraw.context_parallel import ContextParallelGroup, distribution_over
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.state import STATE_KINDS, LayerState, register_state_kind
from trl_longstraw.state.registry import LayerAccount, find_child

from .context_parallel_worker import relative_errors, rollouts, update
from .launch import fork_ranks
from .test_engine import case, full_forward, prepared

# ---------------------------------------------------------------------------------------------------------------------
# The new kind: everything LongStraw needs to know about the mixer below.


class RunningSum(nn.Module):
    """A token mixer: token t reads `o_proj(sum over j <= t of v_proj(x_j))`, the sum carried from one forward to the
    next through the Cache API's recurrent state (as transformers' linear-attention mixers carry theirs)."""

    def __init__(self, hidden_size: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        values = self.v_proj(hidden_states)
        if attention_mask is not None and attention_mask.dim() == 2:  # padding adds nothing to the sum
            values = values * attention_mask[:, -values.shape[1] :, None].to(values.dtype)
        sums = values.cumsum(dim=1)
        if cache is not None:
            before = cache.get_recurrent_state(self.layer_idx)
            if before is not None:
                sums = sums + before[:, None]
            cache.update_recurrent_state(sums[:, -1], self.layer_idx)
        return self.o_proj(sums)


class RunningSumState(LayerState):
    """The running sum after the captured prompt (exact mode: after every capture chunk), `[1, hidden]`."""

    name = "running_sum"
    layer_types = ("linear_attention",)
    roles = frozenset({"recurrent"})
    sharded_layer_types = layer_types

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return find_child(layer, lambda child: isinstance(child, RunningSum))

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        return LayerAccount("running_sum", fixed=mixer.v_proj.out_features * dtype_bytes, per_chunk=exact)

    def __init__(self, mixer, layer_idx, layer_type, prompt):
        super().__init__(mixer, layer_idx, layer_type, prompt)
        self.sums: list[torch.Tensor] = []

    def tensors(self):
        return self.sums

    def chunk_states(self):
        return [self.sums]

    def recurrent_state(self, access, batch_size):
        if access.mode == "decode" and (rows := access.suffix.state(self, "sum")) is not None:
            return rows
        index = access.chunk_index - 1 if access.mode == "recompute" else len(self.sums) - 1
        if index < 0:
            return None
        return self.prompt.placement.stage(self.sums[index], self.device).expand(batch_size, -1)

    def finish_recurrent(self, access, state):
        if access.mode == "decode":
            access.suffix.set_state(self, "sum", state)
        elif access.mode == "recompute":
            access.recorded[self] = state
        elif access.mode == "capture":
            stored = self.prompt.placement.store(state[:1])
            if self.prompt.exact or not self.sums:
                self.sums.append(stored)
            else:
                self.sums[-1] = stored

    def recompute_pairs(self, recorded, chunk_index, start, end):
        leaf = self.sums[chunk_index]
        return [] if leaf.grad is None else [(recorded[:1], leaf.grad.to(recorded.device, recorded.dtype, copy=True))]


# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def running_sum_kind():
    """The kind registered for this file's tests only."""
    register_state_kind(RunningSumState)
    yield
    STATE_KINDS.pop(RunningSumState.name)


def running_sum_model(seed=0):
    """The tiny Qwen3.5 hybrid with every GatedDeltaNet mixer replaced by a `RunningSum` (random weights)."""
    model = build_model("qwen3_5", seed=seed)
    torch.manual_seed(seed + 1)
    for index, layer in enumerate(model.model.layers):
        if layer.block_type == "linear_attention":
            layer.linear_attn = RunningSum(model.config.hidden_size, index)
            for linear in (layer.linear_attn.v_proj, layer.linear_attn.o_proj):
                nn.init.normal_(linear.weight, std=0.05)
    return model


def test_the_registry_maps_the_new_mixer_to_the_new_kind():
    engine = LongStrawEngine(8, 5)
    state = engine.capture(prepared(running_sum_model()), case()[0], first_position=0)
    assert [type(layer).name for layer in state.layers] == ["running_sum"] * 3 + ["attention"]
    assert prompt_state_bytes(running_sum_model(), 28, dtype_bytes=4)["running_sum"] == 3 * 4 * 64


@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_scores_and_replays_equal_one_full_forward(prompt_gradient):
    model = prepared(running_sum_model())
    prompt, completions, lengths = case()
    engine = LongStrawEngine(8, 5, prompt_gradient=prompt_gradient)
    with torch.no_grad():
        want, _ = full_forward(model, prompt, completions, lengths, offset=3)
    state = engine.capture(model, prompt, first_position=3)
    if prompt_gradient == "exact":
        state.requires_grad_()
    with torch.no_grad():
        scored, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    assert (scored - want).abs().max() <= 1e-5
    for member in range(3):
        length = int(lengths[member])
        logps, _ = engine.replay(model, state, prompt[-1:], completions[member], length)
        assert (logps.detach() - want[member, :length]).abs().max() <= 1e-5


class SumCache(DynamicCache):
    """transformers' `DynamicCache` for the reference, keeping each `RunningSum`'s sum (a `DynamicCache` hands back a
    recurrent state only once a conv state was written, which this mixer has none of)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.sums = {}

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.sums.get(layer_idx)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.sums[layer_idx] = recurrent_states
        return recurrent_states


def full_forward_gradients(model, prompt, completions, lengths, weights, detach_prompt):
    """Gradients of `sum(weights * log-probs)` over the members, one full forward each; `detach_prompt`: the prompt's
    contribution to the mixers' sums and the attention's keys and values held constant (detach mode's gradient),
    by two forwards: the prompt's under `no_grad`, then the completion's from its cache."""
    model.zero_grad(set_to_none=True)
    for member in range(len(completions)):
        length = int(lengths[member])
        if detach_prompt:
            cache = SumCache(config=model.config)
            with torch.no_grad():
                model(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
            ids = torch.cat([prompt[-1:], completions[member]])[None]
            labels = ids.clone()
            labels[:, :1] = -100
            labels[:, 1 + length :] = -100
            positions = torch.arange(prompt.numel() - 1, prompt.numel() - 1 + ids.shape[1])[None]
            out = model(input_ids=ids, position_ids=positions, cache=cache, labels=labels, fused_lm_head=True)
            logps = out.log_probs[0, -completions.shape[1] :]
        else:
            logps = full_forward(model, prompt, completions[member : member + 1], lengths[member : member + 1])[0][0]
        (logps[:length] * weights[member, :length]).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_gradients_equal_the_full_forwards_in_both_gradient_modes(prompt_gradient):
    model = prepared(running_sum_model())
    prompt, completions, lengths = case()
    weights = torch.randn(completions.shape, generator=torch.Generator().manual_seed(1))
    want = full_forward_gradients(model, prompt, completions, lengths, weights, prompt_gradient == "detach")
    _, _, _, grads = update(
        LongStrawEngine(8, 5, prompt_gradient=prompt_gradient), model, prompt, completions, lengths, weights, 0
    )
    assert sorted(grads) == sorted(want)
    errors = relative_errors(grads, want, 0.0)
    assert max(errors.values()) <= 1e-4, max(errors, key=errors.get)


def greedy_without_cache(model, prompt, steps):
    """Greedy decoding by one full forward of the whole sequence per token (no cache at all)."""
    ids = prompt[None]
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        logits[0] = float("-inf")  # as the rollout's suppress_tokens=[0]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, prompt.numel() :]


def test_decoding_from_the_captured_sum_gives_the_full_forwards_greedy_tokens():
    model = prepared(running_sum_model())
    prompts = [case(seed)[0] for seed in (0, 1)]
    config = GenerationConfig(
        max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[1], suppress_tokens=[0], disable_compile=True
    )
    tokens, _ = rollouts(LongStrawEngine(8, 5), model, prompts, 2, config)
    for row, prompt in enumerate(p for p in prompts for _ in range(2)):
        assert tokens[row].tolist() == greedy_without_cache(model, prompt, 6).tolist()


def sharded_against_one_process(rank, world_size, init_file, out_dir):
    register_state_kind(RunningSumState)  # a rank is a fresh process: the fixture registered it in the test's only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cp = ContextParallelGroup.of()
        model = prepared(running_sum_model())
        prompt, completions, lengths = case()
        weights = torch.randn(completions.shape, generator=torch.Generator().manual_seed(1))
        results = {}
        for mode in ("detach", "exact"):
            single = update(LongStrawEngine(8, 5, prompt_gradient=mode), model, prompt, completions, lengths, weights)
            engine = LongStrawEngine(8, 5, prompt_gradient=mode, distribution=distribution_over(cp))
            sharded = update(engine, model, prompt, completions, lengths, weights)
            results[mode] = {
                "score_error": (sharded[1] - single[1]).abs().max().item(),
                "grad_error": max(relative_errors(sharded[3], single[3], 0.0).values()),
            }
        config = GenerationConfig(
            max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[1], disable_compile=True
        )
        want, _ = rollouts(LongStrawEngine(8, 5), model, [prompt], 2, config)
        got, _ = rollouts(LongStrawEngine(8, 5, distribution=distribution_over(cp)), model, [prompt], 2, config)
        results["same_tokens"] = torch.equal(got, want)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_rank_context_parallelism_gives_the_single_process_scores_gradients_and_tokens(tmp_path):
    args = (2, str(tmp_path / "init"), str(tmp_path))
    fork_ranks(sharded_against_one_process, args, 2)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["same_tokens"]
        for mode in ("detach", "exact"):
            assert results[mode]["score_error"] <= 1e-5, mode
            assert results[mode]["grad_error"] <= 1e-4, mode


# ---------------------------------------------------------------------------------------------------------------------
# A kind that leaves a duty out is refused at registration.


def kind_without(duty: str):
    """`RunningSumState` with one duty left out: an abstract method, a declared attribute or a method of its role."""
    members = {
        name: value
        for name, value in vars(RunningSumState).items()
        if name != duty and (name == "__init__" or not name.startswith("_"))
    }
    return type("Incomplete", (LayerState,), {**members, "name": "incomplete"})


@pytest.mark.parametrize("duty", ["tensors", "account", "sharded_layer_types", "finish_recurrent", "chunk_states"])
def test_a_kind_that_leaves_a_duty_out_is_refused_at_registration_naming_it(duty):
    with pytest.raises(TypeError, match=f"Incomplete does not implement {duty}"):
        register_state_kind(kind_without(duty))
    assert "incomplete" not in STATE_KINDS


def test_a_kind_with_an_unknown_role_or_a_taken_name_is_refused():
    unknown = type("Unknown", (RunningSumState,), {"name": "unknown", "roles": frozenset({"speculation"})})
    with pytest.raises(TypeError, match="unknown roles \\['speculation'\\]"):
        register_state_kind(unknown)
    taken = type("Taken", (RunningSumState,), {"name": "attention"})
    with pytest.raises(ValueError, match="'attention' is registered already"):
        register_state_kind(taken)
