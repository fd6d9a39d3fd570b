"""Faults across context-parallel ranks, measured: what each rank did and how long after the fault it stopped.

The matrix of `tests/test_faults.py` (a rank raises, is killed with SIGKILL, or stalls, at its second collective of
each phase: capture, score, replay, prompt backward, rollout; 2 ranks, and 3 for three of them), each rank its own
process on gloo, the group's timeout `--timeout` seconds (the Trainer's `ddp_timeout`). Writes
`benchmarks/results/faults/faults.md` (and `.json`): per case, per rank, how it ended and the seconds from the fault
to its error.

    PYTHONPATH=. .venv/bin/python benchmarks/faults.py --timeout 4
"""

import argparse
import json
import tempfile
from pathlib import Path

from tests import test_faults
from tests.test_faults import CASES, launch

RESULTS = Path(__file__).resolve().parent / "results" / "faults"


def short(report: str) -> str:
    """`rank r: <what it reported>` without the backend's text: `raised X`, `failed in <collective>`, `no report`."""
    rank, _, text = report.partition(": ")
    if text.startswith("raised "):
        text = text.split(":")[0]
    elif text.startswith("failed in "):
        text = text.split(" (phase")[0]
    elif text.startswith("no report"):
        text = "no report"
    return f"{rank}: {text}"


def outcome_of(rank: int, faulty: int, fault: str, outcome: dict | None, fault_time: float) -> dict:
    if outcome is None:
        did = "killed (SIGKILL)" if fault == "kill" else "stalled (killed by the harness)"
        return {"rank": rank, "did": did, "seconds": None}
    if rank == faulty:
        return {"rank": rank, "did": f"raised {outcome['error']}", "seconds": 0.0}
    reports = outcome["message"].split("The other ranks of the group:")[-1].strip().splitlines()
    reported = "; ".join(short(line.strip()) for line in reports)
    return {
        "rank": rank,
        "did": f"{outcome['error']} naming {reported}",
        "seconds": round(outcome["time"] - fault_time, 2),
    }


def table(timeout: float, rows: list[dict]) -> str:
    """The cases as a markdown table: each other rank's error (one line per rank) and the slowest one's seconds."""
    lines = [
        f"Group timeout {timeout:g} s. Seconds: from the fault to each other rank's error.",
        "",
        "| ranks | phase | fault (rank) | the other ranks | slowest s |",
        "| ---: | --- | --- | --- | ---: |",
    ]
    for row in rows:
        others = [rank for rank in row["ranks"] if rank["rank"] != row["faulty_rank"]]
        did = "<br>".join(f"rank {rank['rank']}: {rank['did']}" for rank in others)
        slowest = max(rank["seconds"] for rank in others)
        lines.append(
            f"| {row['world_size']} | {row['phase']} | {row['fault']} ({row['faulty_rank']}) | {did} | {slowest:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=4.0, help="the group's timeout (ddp_timeout), seconds")
    args = parser.parse_args()
    test_faults.TIMEOUT_S = args.timeout
    rows = []
    for index, (world_size, phase, fault) in enumerate(CASES):
        faulty = index % world_size
        with tempfile.TemporaryDirectory() as directory:
            outcomes, fault_time, _ = launch(Path(directory), world_size, phase, fault, faulty)
        ranks = [outcome_of(rank, faulty, fault, outcomes[rank], fault_time) for rank in range(world_size)]
        rows.append({"world_size": world_size, "phase": phase, "fault": fault, "faulty_rank": faulty, "ranks": ranks})
        print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "faults.json").write_text(json.dumps({"timeout_s": args.timeout, "cases": rows}, indent=1))
    text = table(args.timeout, rows)
    (RESULTS / "faults.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
