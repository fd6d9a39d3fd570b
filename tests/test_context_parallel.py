"""Context parallelism on 2 CPU ranks (gloo): one prompt sharded across the ranks gives every rank the single-process
log-probs and gradients, and each rank keeps about half of the prompt's pages."""

import dataclasses
import os
from collections import Counter

import pytest
import torch

from trl_longstraw.block_attention import AttentionScalars, KeyBlock
from trl_longstraw.context_parallel import ContextParallelGroup, ShardLayout, capture_attention_pairs
from trl_longstraw.context_parallel.step import StepCall

from .context_parallel_worker import ROLLOUT_FAMILIES, run, run_data_and_context_parallel
from .launch import fork_ranks

# Dense attention, the GatedDeltaNet hybrid (qwen3_5: its one attention layer is the last, so the exact recompute's
# cross-shard page gradients need qwen3_next, whose attention layers feed GatedDeltaNet layers), MLA latent pages.
CASES = [
    ("qwen3", "detach"),
    ("qwen3", "exact"),
    ("qwen3_5", "detach"),
    ("qwen3_next", "exact"),
    # only the attention layers train: the first chunk's frozen recurrent states take no gradient, yet the next
    # chunk's rank sends theirs (received and dropped, or the ranks would wait for each other)
    ("qwen3_5", "exact_attention_trained"),
    ("deepseek_v3", "detach"),
    ("deepseek_v3", "exact"),
    ("glm_moe_dsa", "detach"),  # MLA + DSA with IndexShare: the top-k merged across ranks
    ("glm_moe_dsa", "exact"),
    ("deepseek_v32", "exact"),
    ("mistral", "detach"),  # a sliding window on every layer: each rank keeps its shard's last window - 1 entries
    ("mistral", "exact"),
    ("gpt_oss", "detach"),  # attention sinks, sliding + full layers, MoE
    ("gemma2", "exact"),  # logit soft-capping, sliding + global layers
    ("nemotron_h", "exact"),  # Mamba2 + attention + MoE blocks
]
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results, from one launch for every family and mode."""
    out = tmp_path_factory.mktemp("cp")
    args = (WORLD_SIZE, str(out / "init"), CASES, str(out))
    fork_ranks(run, args, WORLD_SIZE)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def test_every_rank_holds_one_chunk_per_step_dealt_in_zigzag():
    layout = ShardLayout.of(36, 2, 8)  # 36 tokens in chunks of at most 8: 3 steps of 2 chunks of 6
    assert layout.bounds == tuple((start, start + 6) for start in range(0, 36, 6))
    assert [layout.chunks(rank) for rank in (0, 1)] == [[0, 3, 4], [1, 2, 5]]
    assert layout.held_before(1, 14) == 6 + 2 and layout.held_tokens(0) == layout.held_tokens(1) == 18
    assert layout.local_indices(1, torch.tensor([0, 7, 13, 30])).tolist() == [-1, 1, 7, 12]
    assert layout.global_indices(1, 5, 8).tolist() == [11, 12, 13]
    assert layout.next_query(6) == 12 and layout.next_query(18) == 24 and layout.next_query(36) == 36
    sizes = {end - start for start, end in ShardLayout.of(37, 3, 4).bounds}
    assert sizes <= {3, 4} and len(ShardLayout.of(37, 3, 4).bounds) % 3 == 0
    # a prompt barely longer than the group still gives every rank a chunk
    assert [len(ShardLayout.of(5, 2, 1).chunks(rank)) for rank in (0, 1)] == [2, 2]


def test_every_rank_computes_the_same_capture_attention_pairs():
    for size in (2, 3, 4):
        pairs = capture_attention_pairs(ShardLayout.of(4096, size, 256))
        assert sum(pairs) == 4096 * 4097 // 2  # every causal pair once
        assert max(pairs) / min(pairs) < 1.01  # (chunk sizes differ by one token) contiguous shards: 3:1 at cp = 2


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_every_rank_scores_and_replays_the_single_process_log_probs(ranks, case):
    for rank in ranks:
        assert rank[case]["score_error"] <= 1e-5
        assert rank[case]["replay_error"] <= 1e-5


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_every_parameter_gradient_equals_the_single_process_one_on_every_rank(ranks, case):
    for rank in ranks:
        result = rank[case]
        assert result["same_parameters"]
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= 1e-4, worst
        assert result["rank_difference"] == 0.0  # the ranks agree bitwise


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_each_rank_keeps_only_its_chunks(ranks, case):
    results = [rank[case] for rank in ranks]
    layout = ShardLayout.of(36, WORLD_SIZE, 8)
    assert [r["held"] for r in results] == [layout.held(rank) for rank in range(WORLD_SIZE)]
    whole = results[0]["whole_attention_bytes"]
    assert sum(r["attention_bytes"] for r in results) == whole
    window = results[0]["whole_window_bytes"]  # sliding-window layers keep their last window - 1 entries
    recurrent = results[0]["whole_state_bytes"] - whole - window  # fixed-size recurrent state: on every rank
    assert sum(r["window_bytes"] for r in results) == window  # each of them on the one rank that captured it
    for r in results:
        assert r["attention_bytes"] == whole / WORLD_SIZE
        if case[1] == "detach":  # (exact mode keeps a recurrent state per capture chunk, as in one process)
            assert r["state_bytes"] == whole / WORLD_SIZE + r["window_bytes"] + recurrent


@pytest.mark.parametrize("case", [case for case in CASES if case[0] in ("qwen3_5", "qwen3_next", "nemotron_h")])
def test_gated_deltanet_chunks_receive_their_starting_state_after_their_zero_state_pass(ranks, case):
    """State passing: a capture chunk whose previous chunk another rank holds runs each GatedDeltaNet rule from the
    zero state and adds its starting state's share once it arrives (the log-probs and gradients above are those of
    one process); Mamba2 layers wait for their starting states instead."""
    layout = ShardLayout.of(36, WORLD_SIZE, 8)
    for rank, result in enumerate(rank[case] for rank in ranks):
        chunks = range(1, len(layout.bounds))
        handed = sum(layout.owner(c) == rank and layout.owner(c - 1) != rank for c in chunks)
        assert handed > 0
        assert result["deferred_starts"] == handed * result["gated_deltanet_layers"]


@pytest.mark.parametrize(
    "case", [case for case in CASES if case[0] in ("qwen3_5", "qwen3_next") and case[1] == "exact"]
)
def test_gated_deltanet_recompute_chunks_hand_their_state_gradients_over_inside_their_rules(ranks, case):
    """State passing backward: every recomputed chunk with a neighbour on the other rank runs each GatedDeltaNet
    rule so that its backward receives the next chunk's share of its final state's gradient and sends its starting
    state's (the gradients above are those of one process)."""
    layout = ShardLayout.of(36, WORLD_SIZE, 8)
    for rank, result in enumerate(rank[case] for rank in ranks):
        chunks = range(len(layout.bounds))
        bordering = sum(
            layout.owner(c) == rank
            and any(layout.owner(n) != rank for n in (c - 1, c + 1) if 0 <= n < len(layout.bounds))
            for c in chunks
        )
        assert bordering > 0
        assert result["hand_offs"] == bordering * result["gated_deltanet_layers"]


@pytest.mark.parametrize("family", ROLLOUT_FAMILIES)
def test_rollouts_from_a_sharded_state_decode_the_single_process_tokens(ranks, family):
    for rank in ranks:
        for sampling in ("greedy", "sampled", "continued", "extended"):
            result = rank["rollouts"][family][sampling]
            assert result["same_tokens"], sampling
            assert result["logit_error"] <= 1e-5, sampling


def test_the_dsa_selection_sends_the_indexer_inputs_candidates_and_selection_per_token_and_layer(ranks):
    for rank in ranks:
        counted, formula = rank["indexer_communication"]
        assert counted == formula > 0


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_fp8_pages_shard_too_and_score_within_fp8_rounding(ranks, family):
    for rank in ranks:
        to_fp8, to_full, stored_in_fp8 = rank["fp8"][family]
        assert stored_in_fp8
        assert to_fp8 <= 2e-2 and to_full <= 2e-2


def test_a_prompt_shorter_than_the_group_is_refused_naming_the_fix(ranks):
    for rank in ranks:
        assert "Lower context_parallel_size" in rank["short_prompt"]


def test_tool_turns_whose_histories_differ_across_the_ranks_are_refused_naming_the_fix(ranks):
    for rank in ranks:
        assert "Make the tools deterministic" in rank["different_histories"]


def test_layers_not_sharded_yet_are_refused_naming_the_fix(ranks):
    for rank in ranks:
        assert "'chunked_attention'" in rank["chunked"] and "context_parallel_size=1" in rank["chunked"]


def test_context_parallel_size_is_taken_from_accelerate_and_a_disagreement_is_refused(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    from trl_longstraw import LongStrawGRPOConfig

    common = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True}
    assert LongStrawGRPOConfig(**common).context_parallel_size == 1
    adopted = LongStrawGRPOConfig(**common, parallelism_config=ParallelismConfig(cp_size=2))
    assert adopted.context_parallel_size == 2
    assert adopted.parallelism_config is None  # Accelerate's own CP stays off: LongStraw's replaces it
    with pytest.raises(ValueError, match="context_parallel_size=4 but Accelerate's parallelism_config has cp_size=2"):
        LongStrawGRPOConfig(**common, parallelism_config=ParallelismConfig(cp_size=2), context_parallel_size=4)
    with pytest.raises(ValueError, match="positive integer"):
        LongStrawGRPOConfig(**common, context_parallel_size=0)
    # One process cannot build the case (TRL's own check refuses it first); on 2 ranks, 2 rows each, groups of 4 can.
    config = LongStrawGRPOConfig(**common, context_parallel_size=2, per_device_train_batch_size=4, num_generations=4)
    config.per_device_train_batch_size = 2
    with pytest.raises(ValueError, match="2 rows\\) to hold whole groups of num_generations=4"):
        config._validate_context_parallel_batches()


def test_context_parallel_size_is_taken_from_an_accelerate_config_file(tmp_path, monkeypatch):
    """An accelerate config file's `parallelism_config` section reaches the process as environment variables: its cp
    size is adopted, and Accelerate's own CP is turned off there (it would shard the model inputs itself)."""
    from trl_longstraw import LongStrawGRPOConfig

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    config = LongStrawGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert config.context_parallel_size == 2
    assert config.launch_environment() == {"PARALLELISM_CONFIG_CP_SIZE": "1"}  # which the trainer sets


def test_groups_need_a_distributed_launch_and_a_world_the_size_divides(tmp_path):
    import torch.distributed as dist

    from trl_longstraw.context_parallel import ContextParallelError, build_context_parallel_group

    with pytest.raises(ContextParallelError, match="needs a distributed launch: run `accelerate launch"):
        build_context_parallel_group(2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(ContextParallelError, match="does not divide the 1 processes.*launch a multiple of 2"):
            build_context_parallel_group(2)
    finally:
        dist.destroy_process_group()


def test_broadcasting_never_writes_into_the_sources_tensor(tmp_path):
    """The source's tensor may be an activation autograd saved: a copy made for the wire (another device, or here a
    non-contiguous view) must not be written back into it, which would bump its version and break the backward."""
    import torch.distributed as dist

    from trl_longstraw.context_parallel import ContextParallelGroup

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        leaf = torch.randn(3, 4, requires_grad=True)
        saved = (leaf * 2).t()  # non-contiguous: the wire gets a contiguous copy
        loss = (saved * saved).sum()  # saves `saved` for backward
        version = saved._version
        ContextParallelGroup.of(None).broadcast(saved.detach(), source=0, kind="test")
        assert saved._version == version
        loss.backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["detach", "exact"])
def test_data_times_context_parallel_ranks_end_with_the_mean_single_process_gradient(tmp_path, mode):
    """4 ranks, dp = 2 x cp = 2: CP groups {0, 1} and {2, 3} take one prompt each; the world averages gradients."""
    args = (4, str(tmp_path / "init"), mode, str(tmp_path))
    fork_ranks(run_data_and_context_parallel, args, 4)
    for rank in range(4):
        result = torch.load(tmp_path / f"dpcp-{mode}-rank{rank}.pt")
        assert result["context_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= 1e-4, worst
        assert result["rank_difference"] == 0.0


def test_the_ranks_of_a_context_parallel_group_draw_the_rows_of_one_data_parallel_rank():
    """world 4 = dp 2 x cp 2, 6 rows per rank per step (groups of 3): ranks 2g and 2g + 1 get what data-parallel rank g
    of a 2-rank run gets, as a dataloader deals consecutive blocks to consecutive ranks."""
    from trl.trainer.utils import RepeatSampler

    from trl_longstraw.context_parallel import SharedRowsSampler

    rows, generations = 6, 3

    def dealt(stream, ranks):
        blocks = [stream[i : i + rows] for i in range(0, len(stream), rows)]
        return [[index for block in blocks[rank::ranks] for index in block] for rank in range(ranks)]

    def sampler(ranks):
        return RepeatSampler(range(40), generations, rows * ranks // generations, repeat_count=2, seed=7)

    sharded = list(SharedRowsSampler(sampler(4), rows, 2))  # (each pass reshuffles, as TRL's sampler does)
    # an epoch is the dataset once per data-parallel group, so twice the rows of 4 data-parallel ranks
    assert len(SharedRowsSampler(sampler(4), rows, 2)) == len(sharded) == 2 * len(sampler(2))
    data_parallel = dealt(list(sampler(2)), 2)
    context_parallel = dealt(sharded, 4)
    assert context_parallel == [data_parallel[0], data_parallel[0], data_parallel[1], data_parallel[1]]


def test_collectives_pick_the_backend_device_once_and_keep_the_tensors_where_they_are(tmp_path, monkeypatch):
    """gloo: CPU communication tensors; NCCL (only the rule is checked here, no GPU): CUDA's current device. A tensor
    the backend cannot take as it is (here: not contiguous) goes through a copy and comes back in place."""
    import torch.distributed as dist

    from trl_longstraw.context_parallel import ContextParallelGroup, communication

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        cp = ContextParallelGroup.of()
        assert cp.device == torch.device("cpu")
        strided = torch.arange(6.0).view(2, 3).t()
        assert cp.all_reduce(strided, op=dist.ReduceOp.MAX) is strided
        assert strided.tolist() == torch.arange(6.0).view(2, 3).t().tolist()
        assert cp.broadcast(strided, 0) is strided
    finally:
        dist.destroy_process_group()
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(communication.dist, "get_backend", lambda group=None, backend=backend: backend)
        monkeypatch.setattr(communication.torch.cuda, "current_device", lambda: 3)
        assert communication.communication_device() == torch.device("cuda", 3)


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
RECIPE_CONFIGS = [  # (recipe YAML, accelerate config, context_parallel_size)
    ("qwen3_6_27b_qlora_cp8.yaml", "cp8_8gpu.yaml", 8),
    ("qwen3_8b_lora_cp2.yaml", "cp2_2gpu.yaml", 2),
    ("glm5_lora_fsdp2_cp8.yaml", "cp8_64gpu_8nodes.yaml", 8),  # with the weights sharded by FSDP2 over 64 ranks
]


@pytest.mark.parametrize(("recipe", "launcher", "size"), RECIPE_CONFIGS, ids=[c[0] for c in RECIPE_CONFIGS])
def test_context_parallel_recipes_parse_with_the_recipe_parser(recipe, launcher, size, monkeypatch):
    """Every key of the CP recipes is a field of the recipe's parser (a renamed field fails here), the config object
    constructs, and the accelerate config launches a multiple of the CP size as plain multi-GPU processes. Without
    a GPU, TrainingArguments refuses bf16, so the parse adds `--bf16 false` (as the YAMLs' comments say)."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType
    from trl import ModelConfig, TrlParser

    from trl_longstraw import LongStrawGRPOConfig

    monkeypatch.syspath_prepend(os.path.join(CONFIGS, os.pardir, "recipes"))
    from grpo_longstraw import LongStrawScriptArguments

    parser = TrlParser((LongStrawScriptArguments, LongStrawGRPOConfig, ModelConfig))
    overrides = [] if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else ["--bf16", "false"]
    script, training, model = parser.parse_args_and_config(["--config", os.path.join(CONFIGS, recipe), *overrides])
    assert training.context_parallel_size == size and script.dataset_name != "embedded:needle"
    assert training.per_device_train_batch_size * training.steps_per_generation % training.num_generations == 0
    assert training.prompt_gradient == "detach" and model.lora_dropout == 0.0
    # the paper's setup: the same model as configs/qwen3_6_27b_qlora.yaml, NF4 QLoRA, G = 8
    if recipe == "qwen3_6_27b_qlora_cp8.yaml":
        with open(os.path.join(CONFIGS, "qwen3_6_27b_qlora.yaml")) as single:
            assert model.model_name_or_path == yaml.safe_load(single)["model_name_or_path"]
        assert model.load_in_4bit and model.bnb_4bit_quant_type == "nf4" and training.num_generations == 8
    accelerate = load_config_from_file(os.path.join(CONFIGS, "accelerate", launcher))
    assert accelerate.distributed_type == DistributedType.MULTI_GPU
    assert accelerate.num_processes % size == 0 and not accelerate.parallelism_config


def test_context_parallelism_refuses_vllm_whose_rows_differ_per_rank():
    from trl_longstraw import LongStrawGRPOConfig

    with pytest.raises(ValueError, match="context_parallel_size=2 with use_vllm=True"):
        LongStrawGRPOConfig(
            output_dir="unused",
            context_parallel_size=2,
            use_vllm=True,
            num_generations=2,
            per_device_train_batch_size=2,
        )


@pytest.mark.parametrize(
    "setting", [{"scale_rewards": "batch"}, {"multi_objective_aggregation": "normalize_then_sum"}], ids=str
)
def test_context_parallelism_refuses_a_reward_std_over_the_batch(setting):
    """A CP group's rows appear once per rank in TRL's gathered rewards: a batch-wide std would count them cp times."""
    from trl_longstraw import LongStrawGRPOConfig

    name, value = next(iter(setting.items()))
    with pytest.raises(ValueError, match=f"context_parallel_size=2 with {name}='{value}': .*scale_rewards='group'"):
        LongStrawGRPOConfig(
            output_dir="unused",
            context_parallel_size=2,
            num_generations=2,
            per_device_train_batch_size=2,
            bf16=False,
            **setting,
        )


def test_rewards_that_differ_within_a_context_parallel_group_are_refused():
    """The gathered rewards `[world * rows, functions]` hold each CP group's rows once per rank: they must agree
    (NaN, a function that does not apply to a row, agrees with NaN)."""
    from trl_longstraw.context_parallel import ContextParallelError, ContextParallelGroup, check_same_rewards

    cp = ContextParallelGroup(group=None, rank=0, size=2)
    group = torch.tensor([[1.0, float("nan")], [2.0, 0.5], [3.0, 1.0]])
    other_group = torch.tensor([[4.0, 2.0], [5.0, 0.0], [6.0, float("nan")]])
    same = torch.cat([group, group, other_group, other_group])  # world 4 = dp 2 x cp 2, 3 rows per rank
    check_same_rewards(same, cp, rows=3)
    differing = same.clone()
    differing[8, 0] += 1e-6  # rank 2 (second CP group, its first rank) vs rank 3
    with pytest.raises(ContextParallelError, match="different rewards: .*deterministic"):
        check_same_rewards(differing, cp, rows=3)


# Three ranks: a middle rank receives recurrent state and hands it on (and relays its gradient back in exact mode),
# ranks after the owner serve its recompute, attention sinks in the exact backward, DSA candidates from three ranks.
# Four ranks: dense, the GatedDeltaNet hybrid and DSA, with two steps of four chunks (zigzag: the recurrent state
# crosses the step boundary on one rank).
MANY_RANK_CASES = {
    3: [("qwen3_next", "exact"), ("gpt_oss", "exact"), ("glm_moe_dsa", "exact")],
    4: [("qwen3", "detach"), ("qwen3_next", "exact"), ("glm_moe_dsa", "exact")],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(MANY_RANK_CASES))
def test_more_context_parallel_ranks_score_replay_and_back_propagate_as_one_process(tmp_path, world):
    from .context_parallel_worker import run_on_device

    cases = MANY_RANK_CASES[world]
    args = (world, str(tmp_path / "init"), cases, [], str(tmp_path), "cpu")
    fork_ranks(run_on_device, args, world)
    ranks = [torch.load(tmp_path / f"cpu-rank{rank}.pt") for rank in range(world)]
    layout = ShardLayout.of(36, world, 8)
    for case in cases:
        for rank in ranks:
            result = rank[case]
            assert result["score_error"] <= 1e-5 and result["replay_error"] <= 1e-5, case
            assert result["same_parameters"] and result["rank_difference"] == 0.0, case
            assert max(result["grad_errors"].values()) <= 1e-4, case
        assert [rank[case]["held"] for rank in ranks] == [layout.held(rank) for rank in range(world)]


# Long members spread over the group in steps (`segments`), spans members share (`tree`), both (`tree_segments`): a
# state kind of each family (GQA pages with sinks and a sliding window, GatedDeltaNet + attention + MoE, MLA + DSA,
# Mamba2), both prompt-gradient modes.
CONTINUATION_CASES = [
    ("qwen3", "exact", "segments"),
    ("gpt_oss", "exact", "segments"),
    ("qwen3_next", "exact", "tree_segments"),
    ("glm_moe_dsa", "detach", "tree_segments"),
    ("nemotron_h", "exact", "tree"),
]


@pytest.fixture(scope="module")
def continuations(tmp_path_factory):
    from .context_parallel_worker import run_continuations

    out = tmp_path_factory.mktemp("cp-continuations")
    fork_ranks(run_continuations, (WORLD_SIZE, str(out / "init"), CONTINUATION_CASES, str(out)), WORLD_SIZE)
    return [torch.load(out / f"continuations-rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("case", CONTINUATION_CASES, ids="-".join)
def test_members_and_shared_spans_spread_over_the_group_score_and_train_as_whole_replays(continuations, case):
    """A member longer than `replay_segment_size` (members of 7 and 5 tokens in segments of 3: two steps and one)
    and the spans members share (6 and 4 tokens, three and four members below them) are captured and recomputed by
    the CP group step by step, every rank its chunk of each step, as the prompt's chunks are: every rank scores every
    member and ends with the gradient of one process replaying every member whole and alone (float64)."""
    settings = case[2]
    for rank in continuations:
        result = rank[case]
        assert result["score_error"] <= 1e-6 and result["entropy_error"] <= 1e-6
        assert result["same_parameters"]
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= 1e-5, worst
        shared = [(0, 6, [0, 1, 2, 4]), (6, 10, [0, 1, 4])] if settings.startswith("tree") else []
        assert result["spans"] == shared


def test_a_dropped_state_and_its_continuations_are_freed_without_the_garbage_collector(continuations):
    assert all(rank["freed"] for rank in continuations)


def test_the_step_attention_keeps_no_dsa_pick_beside_its_saved_tensors():
    """What `StepAttention` keeps on `ctx` as a Python attribute (which activation checkpointing cannot free: one
    `[tokens, k]` int64 pick per rank and layer would stay for the whole replay) holds no top-k; every rank's selection
    and page picks go through `save_for_backward` and come back as they were."""
    size, tokens, k = 3, 4, 2
    positions = tuple(torch.arange(10, 10 + tokens) for _ in range(size))
    selections = tuple(torch.randint(0, 10, (1, tokens, k)) for _ in range(size))
    pages = tuple((KeyBlock(torch.arange(10), shared=True, picked=selection),) for selection in selections)
    call = StepCall(
        ContextParallelGroup(None, 0, size), None, positions, pages, selections, AttentionScalars(1.0, 4), "rows"
    )
    kept, saved = call.without_tensors()
    assert kept.selections == (None,) * size
    assert all(block.picked is None for blocks in kept.page_blocks for block in blocks)
    assert all(isinstance(tensor, torch.Tensor) for tensor in saved) and len(saved) == 2 * size
    restored = kept.with_tensors(saved)
    assert all(a is b for a, b in zip(restored.selections, selections, strict=True))
    for blocks, selection in zip(restored.page_blocks, selections, strict=True):
        assert blocks[0].picked is selection
    unpicked = dataclasses.replace(
        call, selections=None, page_blocks=((KeyBlock(torch.arange(10), shared=True),),) * size
    )
    kept, saved = unpicked.without_tensors()
    assert kept.selections is None and saved == [None] * size and kept.with_tensors(saved) == unpicked


def test_a_step_computes_every_query_key_pair_once_in_pieces_of_one_chunk_each():
    """Every rank's terms over the step's pieces: each query row reads every rank's pages and each chunk of the step
    up to its own exactly once, computed by one rank, and a piece holds one chunk's rows in all (the step's memory
    does not grow with the CP size)."""
    size, lengths = 4, (7, 7, 6, 6)
    starts = tuple(sum(lengths[:rank]) for rank in range(size))
    positions = tuple(torch.arange(start, start + n) for start, n in zip(starts, lengths, strict=True))
    pages = ((KeyBlock(torch.arange(5), shared=True),),) * size
    computed = Counter()
    for me in range(size):
        cp = ContextParallelGroup(None, me, size)
        call = StepCall(cp, starts, positions, pages, None, AttentionScalars(1.0, 4), "capture")
        own = (me, slice(0, lengths[me]), "own", call.own_blocks())
        for piece in call.pieces():
            assert sum(len(range(rows.start, rows.stop)) for rows in map(call.rows, range(size), [piece] * size)) <= 8
        for rank, rows, source, _ in [own] + [term for piece in call.pieces() for term in call.terms(piece)]:
            holder = me if source in ("pages", "own") else source
            for row in range(rows.start, rows.stop):
                computed[rank, row, "pages" if source == "pages" else "chunk", holder] += 1
    expected = Counter()
    for rank, n in enumerate(lengths):
        for row in range(n):
            expected.update((rank, row, "pages", holder) for holder in range(size))
            expected.update((rank, row, "chunk", holder) for holder in range(rank + 1))
    assert computed == expected
