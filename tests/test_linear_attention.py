"""GatedDeltaNet's chunked rule with a deferred starting state (state passing): the outputs and final state of the
rule started from that state, on transformers' torch path and through a model kernel called twice."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from trl_longstraw.embedded import build_model
from trl_longstraw.state.linear_attention import (
    deferred_start_rule,
    is_gated_deltanet,
    kernel_rule_with_deferred_start,
    torch_rule_with_deferred_start,
)


def rule_inputs(tokens: int, seed: int = 0):
    """A rule call with grouped values (2 key heads, 4 value heads) over a length that is not a multiple of the
    rule's 64-token blocks, and a starting state."""
    generator = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(1, tokens, 2, 16, generator=generator) for _ in range(2))
    value = torch.randn(1, tokens, 4, 8, generator=generator)
    g, beta = -torch.rand(1, tokens, 4, generator=generator), torch.rand(1, tokens, 4, generator=generator)
    return (query, key, value, g, beta), torch.randn(1, 4, 16, 8, generator=generator)


@pytest.mark.parametrize("tokens", [1, 150])
@pytest.mark.parametrize("route", ["torch", "kernel"])
def test_a_deferred_starting_state_gives_the_rule_run_from_it(tokens, route):
    inputs, start = rule_inputs(tokens)
    want, want_final = torch_chunk_gated_delta_rule(
        *inputs, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    if route == "torch":
        got, final = torch_rule_with_deferred_start(*inputs, lambda: start, use_qk_l2norm_in_kernel=True)
    else:
        got, final = kernel_rule_with_deferred_start(
            torch_chunk_gated_delta_rule, *inputs, lambda: start, use_qk_l2norm_in_kernel=True
        )
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-6)


def test_the_starting_state_is_asked_for_after_the_zero_state_pass():
    """What lets the previous chunk's rank finish its own rule meanwhile: `start()` runs once, after the zero-state
    scan (here: after the rule has read every input)."""
    inputs, start = rule_inputs(70)
    asked = []
    torch_rule_with_deferred_start(*inputs, lambda: asked.append(True) or start)
    assert asked == [True]


def test_the_mixer_runs_its_own_kernel_unless_a_starting_state_is_pending():
    model = build_model("qwen3_5", seed=0).eval()
    mixer = next(module for module in model.modules() if is_gated_deltanet(module))
    hidden = torch.randn(1, 20, model.config.hidden_size)
    with torch.no_grad():
        want = mixer(hidden)
        rule = deferred_start_rule(mixer)
        assert deferred_start_rule(mixer) is rule  # put in place once
        torch.testing.assert_close(mixer(hidden), want, rtol=0, atol=0)  # nothing pending: the model's own rule
        rule.pending = lambda: torch.zeros(1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
        torch.testing.assert_close(mixer(hidden), want, rtol=1e-5, atol=1e-6)  # from a zero state: the same
    assert rule.pending is None and rule.deferred_runs == 1


def test_a_kernel_forward_replaced_after_the_rule_was_put_in_place_is_wrapped_again():
    """`kernels.kernelize` after LongStraw: the next deferral wraps the new forward, so a pending starting state always
    reaches the rule the mixer runs."""
    import types

    model = build_model("qwen3_5", seed=0).eval()
    mixer = next(module for module in model.modules() if is_gated_deltanet(module))
    first = deferred_start_rule(mixer)
    kernel = mixer._kernel_funcs["chunk_gated_delta_rule"]
    kernel.forward = types.MethodType(lambda module, *args, **kwargs: first.kernel(*args, **kwargs), kernel)
    rule = deferred_start_rule(mixer)
    assert rule is not first
    rule.pending = lambda: torch.zeros(1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    with torch.no_grad():
        mixer(torch.randn(1, 5, model.config.hidden_size))
    assert rule.deferred_runs == 1 and rule.pending is None
