"""Data parallelism on 2 CPU ranks (gloo): every rank ends the step with the same, averaged update."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_two_ranks_end_the_step_with_identical_weights(prompt_gradient):
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    command = [
        launcher,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        os.path.join(os.path.dirname(__file__), "distributed_worker.py"),
        prompt_gradient,
    ]
    env = dict(os.environ, PYTHONPATH=os.getcwd(), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    # the two ranks share stdout, so their lines may interleave: pick the reports out by pattern
    reports = [json.loads(match) for match in re.findall(r"DP_REPORT (\{[^}]*\})", result.stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["max_rank_difference"] == 0.0
        assert report["moved"] > 0
