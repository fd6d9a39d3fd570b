"""How a test starts several ranks: one module for every multi-rank test.

- `ranks_command` / `run_ranks`: a worker script on gloo ranks launched as a user launches it (`accelerate launch
  --multi_gpu ...`, or `torchrun`), optionally beside one plain process running the single-process reference. For
  workers that go through the Trainer and Accelerate's own set-up.
- `fork_ranks`: `fn(rank, *args)` in processes forked from a server that imported the library once
  (multiprocessing's forkserver): a rank starts in well under a second instead of the ~10 s of imports a spawn redoes,
  and it is not forked from the test process itself, which may run threads (pytest-xdist's workers run one beside the
  tests; a plain fork copies whatever lock such a thread holds, and the rank can hang on it). For tests that drive
  the engine on a process group of their own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

BINARIES = os.path.dirname(sys.executable)
FORKSERVER_PRELOAD = ["tests.conftest"]  # torch, transformers, TRL and the library: what every rank imports


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a launched worker: this checkout importable, W&B off, one thread per rank (2 cores here)."""
    return dict(os.environ, PYTHONPATH=os.getcwd(), WANDB_MODE="disabled", OMP_NUM_THREADS="1", **extra)


def ranks_command(processes: int = 2, launcher: str = "accelerate") -> list[str]:
    """The launcher's command line for `processes` CPU ranks on one machine (a script and its arguments follow)."""
    if launcher == "torchrun":
        return [
            os.path.join(BINARIES, "torchrun"),
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(free_port()),
        ]
    if launcher != "accelerate":
        raise ValueError(f"launcher must be 'accelerate' or 'torchrun', got {launcher!r}")
    command = [os.path.join(BINARIES, "accelerate"), "launch", "--multi_gpu", "--num_processes", str(processes)]
    return command + [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]


def run_ranks(
    worker: Sequence[str],
    processes: int = 2,
    launcher: str = "accelerate",
    alone: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> str:
    """`worker` (a script and its arguments) on `processes` ranks and, with `alone`, that command line run as one
    plain process beside them (the reference the ranks are compared to). Fails the test, with the end of its stderr,
    if either exits non-zero; returns the ranks' stdout."""
    env = worker_env() if env is None else env
    runs = [
        subprocess.Popen(
            [*ranks_command(processes, launcher), *worker],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    ]
    if alone is not None:
        plain = worker_env()
        runs.append(
            subprocess.Popen(
                [sys.executable, *alone], env=plain, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [run.communicate(timeout=timeout) for run in runs]
    for run, (_, stderr) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, stderr[-4000:]
    return outputs[0][0]


def fork_ranks(fn: Callable, args: tuple, processes: int = 2, join: bool = True, start_method: str = "forkserver"):
    """`fn(rank, *args)` on `processes` processes (`torch.multiprocessing.start_processes`), each seeing this process's
    environment as it is now and running one thread (2 cores here); with `join=False` the caller waits for them
    through the returned context. `fn` and `args` are pickled: a function at a module's top level, plain values.
    `start_method="spawn"` where a fresh interpreter is needed (CUDA)."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read once, when the first call starts the server
    return mp.start_processes(
        _in_environment, args=(fn, dict(os.environ), args), nprocs=processes, join=join, start_method=start_method
    )


def _in_environment(rank: int, fn: Callable, environment: dict[str, str], args: tuple):
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(1)
    fn(rank, *args)
