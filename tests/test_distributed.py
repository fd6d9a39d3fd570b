"""Data parallelism on 2 CPU ranks (gloo): every rank ends the step with the same, averaged update."""

import json
import os
import re

import pytest

from .launch import run_ranks


def launch(argument: str) -> list[dict]:
    """`distributed_worker.py argument` on 2 gloo ranks; each rank's report."""
    stdout = run_ranks([os.path.join(os.path.dirname(__file__), "distributed_worker.py"), argument])
    # the two ranks share stdout, so their lines may interleave: pick the reports out by pattern
    reports = [json.loads(match) for match in re.findall(r"DP_REPORT (\{[^}]*\})", stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_two_ranks_end_the_step_with_identical_weights(prompt_gradient):
    for report in launch(prompt_gradient):
        assert report["max_rank_difference"] == 0.0
        assert report["moved"] > 0


@pytest.mark.slow
def test_each_rank_ends_with_the_mean_of_stocks_gradients_over_both_ranks_batches():
    for report in launch("gradient"):
        assert report["error_vs_stock_mean"] <= 1e-4
        assert report["error_vs_own_batch"] > 1e-2  # the batches differ: the mean is not a rank's own gradient


@pytest.mark.slow
def test_a_parameter_only_one_rank_reaches_is_averaged_on_every_rank():
    reports = launch("reached")
    for report in reports:
        assert report["same_reached"] and report["mlp_reached"]
    assert reports[0]["mlp_grad_norm"] == reports[1]["mlp_grad_norm"] > 0  # rank 0's gradient, halved, on both
