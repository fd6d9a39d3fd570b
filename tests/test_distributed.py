"""Data parallelism on 2 CPU ranks (gloo): every rank ends the step with the same, averaged update."""

import json
import os
import re

import pytest

from .launch import run_ranks

CASES = ("detach", "exact", "gradient", "reached")


@pytest.fixture(scope="module")
def reports() -> dict[str, list[dict]]:
    """`distributed_worker.py` on 2 gloo ranks, every case in one launch; each case's report from each rank."""
    stdout = run_ranks([os.path.join(os.path.dirname(__file__), "distributed_worker.py"), *CASES])
    # the two ranks share stdout, so their lines may interleave: pick the reports out by pattern
    found = [json.loads(match) for match in re.findall(r"DP_REPORT (\{[^}]*\})", stdout)]
    by_case = {case: sorted((r for r in found if r["case"] == case), key=lambda r: r["rank"]) for case in CASES}
    assert all([r["rank"] for r in by_case[case]] == [0, 1] for case in CASES), found
    return by_case


@pytest.mark.slow
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_two_ranks_end_the_step_with_identical_weights(reports, prompt_gradient):
    for report in reports[prompt_gradient]:
        assert report["max_rank_difference"] == 0.0
        assert report["moved"] > 0


@pytest.mark.slow
def test_each_rank_ends_with_the_mean_of_stocks_gradients_over_both_ranks_batches(reports):
    for report in reports["gradient"]:
        assert report["error_vs_stock_mean"] <= 1e-4
        assert report["error_vs_own_batch"] > 1e-2  # the batches differ: the mean is not a rank's own gradient


@pytest.mark.slow
def test_a_parameter_only_one_rank_reaches_is_averaged_on_every_rank(reports):
    for report in reports["reached"]:
        assert report["same_reached"] and report["mlp_reached"]
    ranks = reports["reached"]
    assert ranks[0]["mlp_grad_norm"] == ranks[1]["mlp_grad_norm"] > 0  # rank 0's gradient, halved, on both
