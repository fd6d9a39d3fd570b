"""CUDA correctness (run by benchmarks/gpu_check.sh on a lent GPU; skipped where there is no CUDA device).

The same ladder as on CPU, on the GPU kernels: operator fidelity (capture + score vs one full forward), exact-mode
gradients vs a full-sequence backward, the state bitwise unchanged by replays, host-resident (pinned) state giving
the device-resident results, and rollouts from the prompt state token-identical to `generate`. TF32 is disabled so
fp32 means fp32.
"""

import pytest
import torch

from trl_longstraw.embedded import FAMILIES, build_model
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.faults import PhaseOutOfMemoryError, in_phase

from .launch import fork_ranks
from .test_attention import CAUSAL, VISIBILITIES, inputs, ours
from .test_attention import test_bf16_under_autocast_accumulates_like_fp32 as bf16_autocast_check
from .test_engine import case, full_forward, prepared
from .test_families import DSA
from .test_load_balancing import check_engine_against_a_full_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DSA_TIE_FREE = {"index_topk": 12, "index_n_heads": 32}


@pytest.fixture(autouse=True)
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def tie_free(model_type, **kwargs):
    """The family's tiny model; a DSA model at top-12 of 32 index heads, so that prompts longer than its default top-64
    select sparsely and no tie sits at the selection boundary (ReLU scores of 4 heads tie often: test_families)."""
    return build_model(model_type, **(DSA_TIE_FREE if model_type in DSA else {}), **kwargs)


def cuda_model(model_type):
    return prepared(tie_free(model_type)).cuda()


@pytest.mark.parametrize("state_device", [None, "cpu"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_score_matches_full_forward_on_cuda(model_type, state_device):
    model = cuda_model(model_type)
    prompt, completions, lengths = (t.cuda() for t in case(prompt_length=200))
    engine = LongStrawEngine(64, 48, state_device=None if state_device is None else torch.device(state_device))
    with torch.no_grad():
        want, _ = full_forward(model, prompt, completions, lengths)
        state = engine.capture(model, prompt, 0)
        before = [t.clone() for t in state.tensors()]
        got, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    assert (got - want).abs().max() <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(before, state.tensors(), strict=True))
    if state_device == "cpu":
        assert all(t.device.type == "cpu" and t.is_pinned() for t in state.tensors())


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_exact_gradients_match_a_full_backward_on_cuda(model_type):
    check_exact_gradients(cuda_model(model_type))


def split_over_two_devices(model):
    """The first half of the layers (and what comes before them) on cuda:0, the rest and the LM head on the host: a
    model genuinely split over two devices, as `device_map` splits one over GPUs (`main_device="cpu"`: the host's
    modules compute there, nothing is offloaded)."""
    from accelerate import dispatch_model

    layers = len(model.model.layers)
    device_map, after_layers = {"lm_head": "cpu"}, False
    for name, _ in model.model.named_children():
        if name == "layers":
            device_map.update({f"model.layers.{i}": 0 if i < layers // 2 else "cpu" for i in range(layers)})
            after_layers = True
        else:
            device_map[f"model.{name}"] = "cpu" if after_layers else 0
    return dispatch_model(model, device_map, main_device="cpu")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5", "qwen3_moe", "glm_moe_dsa"])
def test_a_model_split_over_devices_scores_and_trains_as_its_full_forward(model_type):
    """`device_map` (TRL's default for one process on several GPUs): every layer's state on its layer's device, the
    scores equal to the split model's own full forward and the exact gradients to its full backward."""
    model = split_over_two_devices(prepared(tie_free(model_type)))
    prompt, completions, lengths = (t.cuda() for t in case(prompt_length=150))
    with torch.no_grad():
        want, _ = full_forward(model, prompt, completions, lengths)
        engine = LongStrawEngine(64, 48)
        state = engine.capture(model, prompt, 0)
        got, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    assert float((got.cpu() - want.cpu()).abs().max()) <= 1e-4
    assert {t.device.type for t in state.tensors()} == {"cuda", "cpu"}  # each layer's state where it computes
    check_exact_gradients(model)


def check_exact_gradients(model):
    prompt, completions, lengths = (t.cuda() for t in case(prompt_length=150))
    want_logps, _ = full_forward(model, prompt, completions, lengths)
    want_logps.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    engine = LongStrawEngine(64, 48, prompt_gradient="exact")
    state = engine.capture(model, prompt, 0).requires_grad_()
    for member in range(len(completions)):
        logps, _ = engine.replay(model, state, prompt[-1:], completions[member], int(lengths[member]))
        logps.sum().backward()
    engine.backward_prompt(model, state, prompt)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    floor = 1e-3 * sum(float(g.norm()) ** 2 for g in want.values()) ** 0.5  # A_log/dt_bias: docs/design.md
    worst = max(float((got[n] - want[n]).norm()) / max(float(want[n].norm()), floor) for n in want)
    assert worst <= 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe", "gpt_oss"])
def test_load_balancing_loss_gradients_match_a_full_backward_on_cuda(model_type):
    check_engine_against_a_full_backward(model_type, "cuda")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_rollout_matches_generate_on_cuda(model_type):
    """Rollouts from the prompt state on the GPU kernels (fla/causal-conv1d where installed): token-identical to
    `generate`, with its logits, on two left-padded prompts."""
    from trl_longstraw.engine import prepare_model
    from trl_longstraw.rollout import PromptRows, decode, prepare_sampling

    from .test_rollout import generation_config, left_padded

    model = tie_free(model_type, seed=0).float().cuda()
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=generator).cuda() for n in (40, 17)]
    # the pad token (0) has a zero embedding: decoded greedily, every DSA index score after it ties
    config = generation_config(max_new_tokens=12, suppress_tokens=[0])
    ids, mask = (t.cuda() for t in left_padded([p.cpu() for p in prompts], 2))
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config, output_logits=True, return_dict_in_generate=True
    )
    want_tokens, want_logits = out.sequences[:, ids.shape[1] :], out.logits
    prepare_model(model)
    engine = LongStrawEngine(16, 16)
    rows = [PromptRows([2 * i, 2 * i + 1], p, engine.capture(model, p, 0)) for i, p in enumerate(prompts)]
    logits = []
    tokens = decode(engine, model, rows, ids, prepare_sampling(model, config, ids, mask), logits)
    assert torch.equal(tokens, want_tokens)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, want_logits, strict=True)) < 1e-4


# Context parallelism on the GPU (one device, shared by both ranks; gloo): a dense, a GatedDeltaNet hybrid and an
# MLA + DSA model, both gradient modes, and rollouts from the sharded state.
CONTEXT_PARALLEL_CASES = [("qwen3", "exact"), ("qwen3_5", "detach"), ("glm_moe_dsa", "exact")]


def test_context_parallel_ranks_on_cuda_give_the_single_process_results(tmp_path):

    from .context_parallel_worker import run_on_device

    args = (2, str(tmp_path / "init"), CONTEXT_PARALLEL_CASES, ["glm_moe_dsa"], str(tmp_path))
    fork_ranks(run_on_device, args, 2, start_method="spawn")  # CUDA forbids fork
    ranks = [torch.load(tmp_path / f"cuda-rank{rank}.pt") for rank in range(2)]
    for family_mode in CONTEXT_PARALLEL_CASES:
        for rank in ranks:
            result = rank[family_mode]
            assert result["communication_device"] == "cpu"  # gloo: the collectives cross to the host and back
            assert result["score_error"] <= 1e-5 and result["replay_error"] <= 1e-5, family_mode
            assert result["same_parameters"] and result["rank_difference"] == 0.0, family_mode
            assert max(result["grad_errors"].values()) <= 1e-4, family_mode
    for rank in ranks:
        for sampling, result in rank["rollouts"]["glm_moe_dsa"].items():
            assert result["same_tokens"] and result["logit_error"] <= 1e-4, sampling


def _on_cuda(tensors, dtype):
    return [t.detach().to("cuda", dtype).requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("chunk", [3, 64])
def test_fused_cuda_kernels_agree_with_plain_torch(chunk, sinks):
    """fp32 on CUDA goes through the memory-efficient forward and backward (the prompt block all visible, the own
    block square causal); float64 on the CPU through plain torch: outputs and every gradient agree."""
    cuda_inputs, plain_inputs = _on_cuda(inputs(torch.float32), torch.float32), inputs(torch.float64)
    grad_out = torch.randn(*plain_inputs[0].shape, dtype=torch.float64)
    results = []
    for tensors in (cuda_inputs, plain_inputs):
        sink = tensors[5] if sinks else None
        out = ours(*tensors[:5], sink, CAUSAL, chunk)
        out.backward(grad_out.to(out.device, out.dtype))
        grads = [t.grad for t in tensors[:5]] + ([sink.grad] if sinks else [])
        results.append([x.double().cpu() for x in [out, *grads]])
    for fused, plain in zip(*results, strict=True):
        assert torch.allclose(fused, plain, atol=2e-5, rtol=1e-4), (fused - plain).abs().max()


@pytest.mark.parametrize("value_dim", [8, 5])  # 5: values narrower than the keys (MLA), zero-padded to 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cuda_path_is_taken_and_agrees_with_the_plain_tiles(dtype, value_dim, monkeypatch):
    """Both CUDA kernels run (the prompt block, the own causal block), and the plain tiles on the same inputs give
    the same output and gradients (bf16: to its rounding; both accumulate in fp32)."""
    from trl_longstraw import block_attention

    calls = []
    forward, backward = block_attention._fused_forward_kernel, block_attention._fused_backward_kernel

    def counting_forward(*args):
        calls.append(("forward", args[3]))
        return forward(*args)

    def counting_backward(*args):
        calls.append(("backward", args[6]))
        return backward(*args)

    results = []
    for fused in (True, False):
        monkeypatch.setattr(block_attention, "_fused_forward_kernel", counting_forward)
        monkeypatch.setattr(block_attention, "_fused_backward_kernel", counting_backward)
        if not fused:
            monkeypatch.setattr(block_attention, "_fusable", lambda *args: None)
        tensors = _on_cuda(inputs(torch.float32, value_dim=value_dim), dtype)
        out = ours(*tensors[:5], None, CAUSAL, 64)
        out.float().square().sum().backward()
        results.append([x.float().cpu() for x in [out] + [t.grad for t in tensors[:5]]])
    assert sorted(calls) == [("backward", False), ("backward", True), ("forward", False), ("forward", True)]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for fused, plain in zip(*results, strict=True):
        assert torch.allclose(fused, plain, atol=tolerance, rtol=tolerance), (fused - plain).abs().max()


@pytest.mark.parametrize("pages", ["on the GPU", "pinned on the host"])
@pytest.mark.parametrize("visibility", ["causal", "window"])
def test_attention_over_the_prompt_makes_no_device_sync(visibility, pages):
    """Each key chunk's kernel is chosen from host positions, a mask (a window's edge) is built on the device from a
    non-blocking copy, and host-resident pages cross head by head from pinned memory: a forward and backward over a
    chunked prompt block and the own block never wait for the GPU (a sync per chunk would stall the queue behind the
    host on every chunk of every layer of every forward)."""
    q, prefix_k, prefix_v, own_k, own_v = _on_cuda(inputs(torch.float32), torch.float32)[:5]
    if pages == "pinned on the host":  # host-resident state, read-only as in detach mode
        prefix_k, prefix_v = (t.detach().cpu().pin_memory() for t in (prefix_k, prefix_v))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ours(q, prefix_k, prefix_v, own_k, own_v, None, VISIBILITIES[visibility], 4)
        out.square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert q.grad is not None and own_k.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm5_width_latent_pages_take_the_cuda_kernels(dtype, monkeypatch):
    """MLA at GLM-5's width (absorbed queries of 576 = latent 512 + rope 64 over one latent head, values its first
    512 columns): the kernels' wide-head variants, fused against the plain tiles, forward and gradients."""
    from trl_longstraw import block_attention
    from trl_longstraw.block_attention import AttentionScalars, KeyBlock, attention_over_blocks

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 7, 576, generator=generator) * 0.05
    pages = torch.randn(1, 300, 576, generator=generator)
    own = torch.randn(1, 7, 576, generator=generator)
    positions = torch.arange(300, 307)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(block_attention, "_fusable", lambda *args: None)
        leaves = [t.to("cuda", dtype).requires_grad_(True) for t in (q, pages, own)]
        blocks = [
            (leaves[1], leaves[1][..., :512], KeyBlock(torch.arange(300, device="cuda"), shared=True)),
            (leaves[2], leaves[2][..., :512], KeyBlock(positions.cuda(), shared=False)),
        ]
        out = attention_over_blocks(leaves[0], blocks, positions.cuda(), AttentionScalars(576**-0.5, 128))
        out.float().square().sum().backward()
        results.append([x.float().cpu() for x in [out] + [t.grad for t in leaves]])
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for fused, plain in zip(*results, strict=True):
        assert torch.allclose(fused, plain, atol=tolerance, rtol=tolerance), (fused - plain).abs().max()


def test_bf16_under_cuda_autocast_accumulates_like_fp32():
    bf16_autocast_check("cuda")


def test_fsdp2_on_one_gpu_gives_the_unsharded_log_probs_and_gradients(tmp_path):
    """The FSDP2 path (root hooks, the agreement before each pass, the synced reduction) on a 1-rank NCCL group."""
    import torch.distributed as dist

    from .test_fsdp import check_one_rank_engine_against_the_unsharded_model

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        check_one_rank_engine_against_the_unsharded_model("cuda")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_moe", "glm_moe_dsa"])
def test_the_memory_plan_against_cuda_allocations(family):
    """`trl-longstraw plan`'s terms against the CUDA allocator (fp32, full fine-tuning): the weights and the prompt
    state as allocated (up to the allocator's 512-byte rounding per tensor), and the replay's working set within 5x of
    the allocation one replay's forward adds (the CPU test bounds it by what autograd saves: test_plan.py)."""
    from trl_longstraw.accounting import UpdateSetup
    from trl_longstraw.plan import plan_run

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = cuda_model(family)
    tensors = [*model.parameters(), *model.buffers()]
    setup = UpdateSetup(
        prompt_tokens=61, completion_tokens=70, group_size=1, lora_rank=None, activation_checkpointing=False,
        prefill_chunk_size=32, attention_chunk_size=16, dtype_bytes=4, prompts_per_generation=0,
    )  # fmt: skip
    plan = plan_run(model.config, setup)
    weights = torch.cuda.memory_allocated() - before
    assert plan.account.weights.bytes <= weights <= plan.account.weights.bytes + 512 * len(tensors)
    prompt, _, _ = case(prompt_length=setup.prompt_tokens)
    engine = LongStrawEngine(setup.prefill_chunk_size, setup.attention_chunk_size)
    before = torch.cuda.memory_allocated()
    state = engine.capture(model, prompt.cuda(), first_position=0)
    kept = torch.cuda.memory_allocated() - before
    assert plan.state_bytes <= kept <= plan.state_bytes + 512 * len(state.tensors())
    completion = torch.randint(2, 100, (setup.completion_tokens,), generator=torch.Generator().manual_seed(1))
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logps, _ = engine.replay(model, state, prompt[-1:].cuda(), completion.cuda(), setup.completion_tokens)
    added = torch.cuda.max_memory_allocated() - before
    assert added / 5 <= plan.account.replay.bytes <= 5 * added, (plan.account.replay.bytes, added)
    del logps


def test_a_cuda_allocation_failure_in_a_phase_is_re_raised_explained():
    """A real CUDA out-of-memory error (twice the device's memory) inside a phase: `PhaseOutOfMemoryError` with the
    explanation, the allocator's error as its cause (the trainer's explanation is tested on CPU: test_faults.py)."""
    too_much = 2 * torch.cuda.get_device_properties(0).total_memory
    explain = lambda phase: f"settings for {phase}"
    with pytest.raises(PhaseOutOfMemoryError, match="settings for capture") as raised, in_phase("capture", explain):
        torch.empty(too_much, dtype=torch.uint8, device="cuda")
    assert isinstance(raised.value.__cause__, torch.cuda.OutOfMemoryError)
