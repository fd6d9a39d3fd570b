"""Context parallelism on 2 CPU ranks (gloo): one prompt sharded across the ranks gives every rank the single-process
log-probs and gradients, and each rank keeps about half of the prompt's pages."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from trl_longstraw.context_parallel import capture_attention_pairs, shard_bounds

from .context_parallel_worker import run

CASES = [(family, mode) for family in ("qwen3", "qwen3_5") for mode in ("detach", "exact")]
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results, from one spawn for every family and mode (the spawn's imports dominate the time)."""
    out = tmp_path_factory.mktemp("cp")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(run, args=(WORLD_SIZE, str(out / "init"), CASES, str(out)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def test_contiguous_shards_cover_the_prompt_once():
    assert shard_bounds(36, 2) == [(0, 18), (18, 36)]
    assert shard_bounds(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert capture_attention_pairs(4, 2) == [3 + 4, 3]  # rank 0's keys serve both shards' queries


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
def test_each_rank_keeps_only_its_shard(ranks, case):
    results = [rank[case] for rank in ranks]
    assert [r["shard"] for r in results] == shard_bounds(36, WORLD_SIZE)
    whole = results[0]["whole_attention_bytes"]
    assert sum(r["attention_bytes"] for r in results) == whole
    recurrent = results[0]["whole_state_bytes"] - whole  # fixed-size recurrent state: replicated on every rank
    for r in results:
        assert r["attention_bytes"] == whole / WORLD_SIZE
        if case[1] == "detach":  # (exact mode keeps a recurrent state per capture chunk, as in one process)
            assert r["state_bytes"] == whole / WORLD_SIZE + recurrent


def test_a_prompt_shorter_than_the_group_is_refused_naming_the_fix(ranks):
    for rank in ranks:
        assert "Lower context_parallel_size" in rank["short_prompt"]
