"""GatedDeltaNet's chunked rule under state passing: with a deferred starting state (a capture chunk's), the outputs
and final state of the rule started from that state; with its state gradients handed across ranks (an exact-mode
recompute chunk's), the gradients of the rule whose final state gets the late share too. On transformers' torch path
and through a model kernel."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from trl_longstraw.embedded import build_model
from trl_longstraw.ops.gated_delta_rule import (
    StateGradientHandOff,
    StatePassing,
    kernel_rule_with_deferred_start,
    kernel_rule_with_state_gradient_hand_off,
    naive_gated_delta_rule,
    torch_rule_with_deferred_start,
    torch_rule_with_state_gradient_hand_off,
)
from trl_longstraw.state.linear_attention import is_gated_deltanet, state_passing_rule


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


def test_the_chunked_rules_follow_the_token_by_token_recurrence():
    """The naive reference against transformers' chunked rule and ours (from a starting state, in 3 blocks of 64),
    with the L2-normalised queries and keys every GatedDeltaNet model uses (unnormalised random keys make the rule
    itself unstable)."""
    l2norm = True
    inputs, start = rule_inputs(150)
    inputs = tuple(x.double() for x in inputs)
    start = start.double()
    want, want_final = naive_gated_delta_rule(*inputs, initial_state=start, use_qk_l2norm_in_kernel=l2norm)
    theirs, their_final = torch_chunk_gated_delta_rule(
        *inputs, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    ours, our_final = torch_rule_with_deferred_start(*inputs, lambda: start, use_qk_l2norm_in_kernel=l2norm)
    for got, final in ((theirs, their_final), (ours, our_final)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final.double(), want_final.double(), rtol=1e-5, atol=1e-6)


def test_a_state_passing_is_one_thing_and_one_is_pending_at_a_time():
    """A call either starts late or hands its gradients off; a rule handed a second one while the first was never
    taken refuses it (the first would otherwise reach a later, unrelated call)."""
    with pytest.raises(ValueError, match="exactly one"):
        StatePassing()
    with pytest.raises(ValueError, match="exactly one"):
        StatePassing(start=lambda: None, hand_off=StateGradientHandOff(None, None))
    model = build_model("qwen3_5", seed=0)
    rule = state_passing_rule(next(module for module in model.modules() if is_gated_deltanet(module)))
    first = StatePassing(start=lambda: None)
    rule.expect(first)
    with pytest.raises(RuntimeError, match="still pending"):
        rule.expect(StatePassing(start=lambda: None))
    assert rule.withdraw() is first and rule.expected is None


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
        rule = state_passing_rule(mixer)
        assert state_passing_rule(mixer) is rule  # put in place once
        torch.testing.assert_close(mixer(hidden), want, rtol=0, atol=0)  # nothing pending: the model's own rule
        passing = StatePassing(start=lambda: torch.zeros(1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim))
        rule.expect(passing)
        torch.testing.assert_close(mixer(hidden), want, rtol=1e-5, atol=1e-6)  # from a zero state: the same
    assert passing.taken and rule.expected is None and rule.deferred_runs == 1


def test_a_kernel_forward_replaced_after_the_rule_was_put_in_place_is_wrapped_again():
    """`kernels.kernelize` after LongStraw: the next deferral wraps the new forward, so a pending starting state always
    reaches the rule the mixer runs."""
    import types

    model = build_model("qwen3_5", seed=0).eval()
    mixer = next(module for module in model.modules() if is_gated_deltanet(module))
    first = state_passing_rule(mixer)
    kernel = mixer._kernel_funcs["chunk_gated_delta_rule"]
    kernel.forward = types.MethodType(lambda module, *args, **kwargs: first.kernel(*args, **kwargs), kernel)
    rule = state_passing_rule(mixer)
    assert rule is not first
    rule.expect(StatePassing(start=lambda: torch.zeros(1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)))
    with torch.no_grad():
        mixer(torch.randn(1, 5, model.config.hidden_size))
    assert rule.deferred_runs == 1 and rule.expected is None


def rule_gradients(rule, inputs, start, d_out, d_final):
    """The gradients of `rule(*inputs, start) -> (out, final)` for the inputs and the starting state."""
    leaves = [x.clone().requires_grad_() for x in (*inputs, start)]
    out, final = rule(*leaves)
    torch.autograd.backward((out, final), (d_out, d_final))
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("tokens", [1, 150])
@pytest.mark.parametrize("route", ["torch", "kernel"])
def test_a_state_gradient_hand_off_gives_the_rule_gradients_with_the_late_share(tokens, route):
    """The late share of the final state's gradient (the next chunk's rank's) joins the gradients at hand: every
    input's gradient and the starting state's are those of the plain rule given both shares at once, and the
    starting state's whole gradient is sent once, after the late share was received."""
    inputs, start = rule_inputs(tokens)
    generator = torch.Generator().manual_seed(1)
    d_out = torch.randn(1, tokens, 4, 8, generator=generator)
    d_local, d_late = (torch.randn(1, 4, 16, 8, generator=generator) for _ in range(2))

    def plain(query, key, value, g, beta, state):
        return torch_chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    want = rule_gradients(plain, inputs, start, d_out, d_local + d_late)
    events = []
    hand_off = StateGradientHandOff(
        receive=lambda final: events.append("received") or d_late.clone(),
        send=lambda grad: events.append(("sent", grad.clone())),
    )

    def handed_off(query, key, value, g, beta, state):
        if route == "torch":
            return torch_rule_with_state_gradient_hand_off(query, key, value, g, beta, state, hand_off, True)
        return kernel_rule_with_state_gradient_hand_off(
            torch_chunk_gated_delta_rule, query, key, value, g, beta, state, hand_off, use_qk_l2norm_in_kernel=True
        )

    got = rule_gradients(handed_off, inputs, start, d_out, d_local)
    for name, a, b in zip(("query", "key", "value", "g", "beta", "start"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert [event if isinstance(event, str) else event[0] for event in events] == ["received", "sent"]
    torch.testing.assert_close(events[1][1], want[-1], rtol=1e-4, atol=1e-5)


def test_a_hand_off_without_a_late_share_or_a_previous_rank_neither_receives_nor_sends():
    """The prompt's first chunk (no starting state) whose next chunk is here: the plain rule's gradients."""
    inputs, start = rule_inputs(70)
    d_out, d_final = torch.randn(1, 70, 4, 8), torch.randn(1, 4, 16, 8)
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, final = torch_rule_with_state_gradient_hand_off(*leaves, None, StateGradientHandOff(None, None), True)
    torch.autograd.backward((out, final), (d_out, d_final))
    want = rule_gradients(
        lambda *args: torch_chunk_gated_delta_rule(
            *args[:5], initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
        ),
        inputs,
        start,
        d_out,
        d_final,
    )
    for a, b in zip((leaf.grad for leaf in leaves), want[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_pending_hand_off_is_taken_by_the_next_rule_call_only():
    """A hand-off needs the rule's final state (a recompute forward has a cache): a call without one is refused, and
    the hand-off does not outlive it."""
    model = build_model("qwen3_5", seed=0)
    mixer = next(module for module in model.modules() if is_gated_deltanet(module))
    hidden = torch.randn(1, 20, model.config.hidden_size)
    with torch.no_grad():
        want = mixer(hidden)
        rule = state_passing_rule(mixer)
        passing = StatePassing(hand_off=StateGradientHandOff(receive=None, send=None))
        rule.expect(passing)
        with pytest.raises(RuntimeError, match="without a final state"):
            mixer(hidden)
        assert rule.expected is None and rule.hand_off_runs == 0 and not passing.taken
        torch.testing.assert_close(mixer(hidden), want, rtol=0, atol=0)  # the model's own rule again
