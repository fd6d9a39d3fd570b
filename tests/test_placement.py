"""Where a prompt state lives and how it is stored: fp8 pages with per-(page, head) scales."""

import pytest
import torch

from trl_longstraw import block_attention
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.state.placement import FP8_MAX, FP8_PAGE_TOKENS, Pages, Placement, dequantize_pages
from trl_longstraw.state.recurrent import ConvRecurrentState

from .test_engine import case, prepared


def spread_values(tokens=300):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, tokens, 16, generator=generator) * torch.linspace(0.1, 10, tokens)[None, :, None]


def test_fp8_pages_do_not_depend_on_how_the_capture_was_chunked():
    values = spread_values()
    whole = Pages(Placement("cpu"), 300, fp8=True)
    whole.append(values)
    chunked = Pages(Placement("cpu"), 300, fp8=True)
    for start in range(0, 300, 37):  # chunks that straddle page boundaries
        chunked.append(values[:, start : start + 37])
    assert torch.equal(whole.data.view(torch.uint8), chunked.data.view(torch.uint8))
    assert torch.equal(whole.scales, chunked.scales)


def test_fp8_pages_round_each_entry_within_its_page_scale():
    values = spread_values()
    pages = Pages(Placement("cpu"), 300, fp8=True)
    pages.append(values)
    restored = dequantize_pages(pages.data, pages.scales, torch.arange(300), FP8_PAGE_TOKENS, torch.float32)
    per_token_amax = (pages.scales * FP8_MAX).repeat_interleave(FP8_PAGE_TOKENS, dim=1)[:, :300, None]
    # e4m3 keeps 3 mantissa bits: an entry is off by at most 2^-4 of the largest value of its page (and head)
    assert torch.all((restored - values).abs() <= per_token_amax * 2**-4 + 1e-12)
    assert pages.data.dtype == torch.float8_e4m3fn and pages.scales.shape == (2, -(-300 // FP8_PAGE_TOKENS))


def test_fp8_pages_store_each_pages_largest_entry_at_the_formats_largest_value():
    """The scale uses the format's whole range: a smaller one overflows, a larger one wastes precision."""
    values = spread_values()
    pages = Pages(Placement("cpu"), 300, fp8=True)
    pages.append(values)
    stored = torch.nn.functional.pad(
        pages.data.float().abs(), (0, 0, 0, pages.scales.shape[1] * FP8_PAGE_TOKENS - 300)
    )
    page_amax = stored.view(2, -1, FP8_PAGE_TOKENS, 16).amax(dim=(2, 3))
    assert torch.equal(page_amax, torch.full_like(page_amax, FP8_MAX))
    expected = torch.nn.functional.pad(values.abs(), (0, 0, 0, page_amax.shape[1] * FP8_PAGE_TOKENS - 300))
    assert torch.allclose(pages.scales * FP8_MAX, expected.view(2, -1, FP8_PAGE_TOKENS, 16).amax(dim=(2, 3)))


def test_an_all_zero_fp8_page_dequantizes_to_zeros():
    values = spread_values(128)
    values[1, FP8_PAGE_TOKENS:] = 0  # the second head's second page
    pages = Pages(Placement("cpu"), 128, fp8=True)
    pages.append(values)
    restored = dequantize_pages(pages.data, pages.scales, torch.arange(128), FP8_PAGE_TOKENS, torch.float32)
    assert torch.equal(restored[1, FP8_PAGE_TOKENS:], torch.zeros(FP8_PAGE_TOKENS, 16))
    assert torch.isfinite(pages.scales).all() and (pages.scales > 0).all()


def test_one_non_finite_entry_in_a_written_chunk_is_reported():
    placement = Placement("cpu")
    pages = Pages(placement, 300)
    pages.append(spread_values(100))
    chunk = spread_values(100)
    chunk[1, 37, 5] = float("nan")
    pages.append(chunk)
    pages.append(spread_values(100))  # a later finite chunk does not clear the flag
    assert not placement.all_finite()


def test_fp8_entries_gathered_by_a_top_k_dequantize_with_their_own_pages_scales():
    """A DSA top-k reads entries scattered over many pages, `[heads, batch, tokens, k]` at once."""
    values = spread_values()
    pages = Pages(Placement("cpu"), 300, fp8=True)
    pages.append(values)
    whole = dequantize_pages(pages.data, pages.scales, torch.arange(300), FP8_PAGE_TOKENS, torch.float32)
    picked = torch.tensor([[[5, 299, 64], [63, 0, 128]]])  # [batch, tokens, k], across pages
    gathered = dequantize_pages(pages.data[:, picked], pages.scales, picked, FP8_PAGE_TOKENS, torch.float32)
    assert torch.equal(gathered, whole[:, picked])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss", "deepseek_v3", "glm_moe_dsa"])
def test_fp8_state_halves_the_pages_and_scores_close_to_the_model_dtype(family):
    """K/V pages and MLA latent pages in fp8; windows, recurrent states and DSA indexer keys stay in the model dtype."""
    model = prepared(build_model(family, dtype=torch.bfloat16))
    prompt, completions, lengths = case(prompt_length=257)
    exact_pages, fp8_pages = LongStrawEngine(64, 50), LongStrawEngine(64, 50, prompt_state_dtype="float8_e4m3fn")
    with torch.no_grad():
        state = exact_pages.capture(model, prompt, 0)
        want, _ = exact_pages.score(model, state, prompt[-1:], completions, lengths, 3)
        fp8_state = fp8_pages.capture(model, prompt, 0)
        got, _ = fp8_pages.score(model, fp8_state, prompt[-1:], completions, lengths, 3)

    def paged(layer):
        return type(layer).name == "mla_latent" or (type(layer).name == "attention" and not layer.rolling)

    full = [t for layer in state.layers if paged(layer) for t in layer.tensors()]
    fp8 = [t for layer in fp8_state.layers if paged(layer) for t in layer.tensors()]
    assert all(
        t.dtype == torch.float8_e4m3fn for layer in fp8_state.layers if paged(layer) for t in layer.tensors()[:1]
    )
    full_bytes = sum(t.numel() * t.element_size() for t in full)
    fp8_bytes = sum(t.numel() * t.element_size() for t in fp8)
    assert fp8_bytes <= 0.55 * full_bytes  # 1 byte instead of 2, plus one fp32 scale per 64 tokens and head
    assert (got.float() - want.float()).abs().max() <= 0.05


@pytest.mark.parametrize("prompt_state_dtype", ["auto", "float8_e4m3fn"])
def test_dsa_pages_staged_from_another_device_give_the_same_state_and_scores(monkeypatch, prompt_state_dtype):
    """Host-resident DSA pages on a GPU stage each picked entry once (`block_attention.pages_elsewhere`, forced here: one
    device): the same capture and the same log-probs, bit for bit, fp8 entries dequantised with their pages' scales."""
    model = prepared(build_model("glm_moe_dsa", dtype=torch.bfloat16))
    prompt, completions, lengths = case(prompt_length=257)
    engine = LongStrawEngine(64, 50, prompt_state_dtype=prompt_state_dtype)
    results = []
    for elsewhere in (False, True):
        monkeypatch.setattr(block_attention, "pages_elsewhere", lambda keys, q, elsewhere=elsewhere: elsewhere)
        with torch.no_grad():
            state = engine.capture(model, prompt, 0)
            results.append((state.tensors(), engine.score(model, state, prompt[-1:], completions, lengths, 3)[0]))
    (here, scored_here), (staged, scored_staged) = results
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(here, staged, strict=True))
    assert torch.equal(scored_here, scored_staged)


def test_fp8_state_replays_in_detach_mode_and_stays_unchanged():
    model = prepared(build_model("qwen3"))
    prompt, completions, lengths = case(prompt_length=100)
    engine = LongStrawEngine(30, 20, prompt_state_dtype="float8_e4m3fn")
    state = engine.capture(model, prompt, 0)
    before = [t.clone() for t in state.tensors()]
    scored, _ = engine.score(model, state, prompt[-1:], completions, lengths, 1)
    logps, _ = engine.replay(model, state, prompt[-1:], completions[0], int(lengths[0]))
    logps.sum().backward()
    assert torch.allclose(logps.detach(), scored[0], atol=1e-6)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)
        for a, b in zip(before, state.tensors(), strict=True)
    )


def test_fp8_state_with_the_exact_prompt_gradient_is_refused():
    with pytest.raises(ValueError, match="fp8 prompt-state pages with the exact prompt gradient"):
        LongStrawEngine(8, 8, prompt_gradient="exact", prompt_state_dtype="float8_e4m3fn").capture(
            prepared(build_model("qwen3")), case()[0], 0
        )


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_each_capture_chunk_stages_the_recurrent_states_it_continues(family, monkeypatch):
    """A host-resident state on a GPU must come back to the compute device before the next capture chunk continues
    it. The GPU tests check the devices; on CPU this checks the route: every chunk after the first reads each
    recurrent layer's conv and recurrent states through `Placement.stage`."""
    staged = []
    stage = Placement.stage
    monkeypatch.setattr(
        Placement, "stage", staticmethod(lambda tensor, device: staged.append(tensor) or stage(tensor, device))
    )
    model = prepared(build_model(family))
    prompt, _, _ = case(prompt_length=33)  # 32 captured tokens: 4 chunks of 8
    state = LongStrawEngine(8, 4, state_device=torch.device("cpu")).capture(model, prompt, 0)
    for layer in (layer for layer in state.layers if isinstance(layer, ConvRecurrentState)):
        for final in (layer.conv[-1], layer.recurrent[-1]):
            same_shape = [tensor for tensor in staged if tensor.shape == final.shape]
            assert len(same_shape) >= 3, (layer.layer_idx, tuple(final.shape))
