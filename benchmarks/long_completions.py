"""Long completions: one GRPO update of a group of 2 members of R tokens each, replayed whole and in segments
(`replay_segment_size`), against stock GRPOTrainer; each run a fresh `update_worker.py` process.

    PYTHONPATH=. .venv/bin/python benchmarks/long_completions.py --presets dense-tiny,hybrid-gdn-tiny \
        --lengths 4096,16384 --segment-sizes 1024,4096 --out benchmarks/results/cpu-2core-long-completions
    PYTHONPATH=. .venv/bin/python benchmarks/long_completions.py --tree --presets dense-tiny,hybrid-gdn-tiny \
        --lengths 4096 --group-size 8 --shared-prefix 2048 --out benchmarks/results/cpu-2core-long-completions

Runs every (preset, R) in `--lengths` as: `stock-serialized` (one row per micro-step), `longstraw-exact` whole, and
`longstraw-exact` in segments of each `--segment-sizes`, all with TRL's default activation checkpointing on;
`--whole-up-to` and `--stock-up-to` skip the first two at longer R (their graph grows with R). With `--tree`, instead:
a group of `--group-size` members of R tokens whose first `--shared-prefix` tokens are alike, as stock, as LongStraw
sharing that span once, and as LongStraw replaying every member from the prompt. Prompt P = 1,024, exact mode
(stock's gradient), `dapo`, fp32, one thread. `--rounds N` repeats the grid N times, interleaved, and keeps each configuration's
fastest time (its peak is the same every round). Rows accumulate in `results.json`; `summary.md` is written from all of
them. Memory: `update_peak_bytes` (the process's RSS high-water mark above its baseline during the update, on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 1024**3
PROMPT_LENGTH = 1024  # the prompt stays short: the completions are what these runs measure


def configurations(args) -> list[dict]:
    if args.tree:  # G members of R tokens whose first `--shared-prefix` are alike, as stock, shared once, each alone
        runs = [("stock-serialized", True), ("longstraw-exact", True), ("longstraw-exact", False)]
        return [
            {
                "preset": preset,
                "R": length,
                "mode": mode,
                "segment": None,
                "shared": args.shared_prefix,
                "spans": spans,
            }
            for preset in args.presets
            for length in args.lengths
            for mode, spans in runs
        ]
    grid = []
    for preset in args.presets:
        for length in args.lengths:
            runs = []
            if length <= args.stock_up_to:
                runs.append(("stock-serialized", None))
            if length <= args.whole_up_to:
                runs.append(("longstraw-exact", None))
            runs += [("longstraw-exact", size) for size in args.segment_sizes if size < length]
            grid += [{"preset": preset, "R": length, "mode": mode, "segment": size} for mode, size in runs]
    return grid


def run(config: dict, args) -> dict:
    command = [
        sys.executable,
        str(HERE / "update_worker.py"),
        "--mode",
        config["mode"],
        "--preset",
        config["preset"],
        "--prompt-length",
        str(PROMPT_LENGTH),
        "--group-size",
        str(args.group_size if config.get("shared") else 2),
        "--completion-length",
        str(config["R"]),
        "--prefill-chunk-size",
        str(args.prefill_chunk_size),
        "--gradient-checkpointing",
        "on",
    ]
    if config["segment"] is not None:
        command += ["--replay-segment-size", str(config["segment"])]
    if config.get("shared"):
        command += ["--shared-prefix", str(config["shared"])]
        if not config["spans"]:
            command.append("--no-shared-spans")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.time_cap_s, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"status": "error", "reason": done.stderr[-500:]}
    except subprocess.TimeoutExpired:
        row = {"status": "timeout(cap)"}
    row.update(config, wall_s=time.perf_counter() - started)
    return row


def key(row: dict) -> tuple:
    return row["preset"], row["R"], row["mode"], row["segment"], row.get("shared"), row.get("spans")


def summary(rows: list[dict], commands: list[str]) -> str:
    best: dict[tuple, dict] = {}
    for row in rows:
        kept = best.get(key(row))
        if (
            kept is None
            or kept.get("status") != "ok"
            or (row.get("status") == "ok" and row["update_time_s"] < kept["update_time_s"])
        ):
            best[key(row)] = row
    lines = [
        "# Long completions: members of R tokens, whole, in segments, and sharing a prefix",
        "",
        "Commands (each adds its rows to results.json; the tables are written from all of them):",
        "",
        *[f"    PYTHONPATH=. .venv/bin/python benchmarks/long_completions.py {command}" for command in commands],
        "",
        (
            "Exact mode (stock's gradient), dapo, fp32, activation checkpointing on (TRL's default) in every run, one "
            "thread per run, CPU, P = 1,024. Peak: RSS above the baseline during the update (weights excluded; gradients "
            "and the optimizer state included). Time: the update (capture, scoring, replay, prompt backward), the fastest "
            "of the rounds. `replay GiB added`: LongStraw's replay phase, above the RSS it started from."
        ),
        "",
        "## One group of 2 members of R tokens",
        "",
        "`x whole`: against LongStraw replaying the member whole at the same R.",
        "",
        "| model | R | run | segment | peak GiB | x whole | replay GiB added | update s | x whole |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    single = {k: row for k, row in best.items() if not k[4]}
    for k, row in sorted(single.items(), key=lambda item: _order(item[0])):
        preset, length, mode, segment = k[:4]
        whole = single.get((preset, length, "longstraw-exact", None, None, None), {})
        lines.append(_line(row, whole, [preset, str(length), RUNS[mode], str(segment or "-")]))
    trees = {k: row for k, row in best.items() if k[4]}
    if trees:
        lines += [
            "",
            "## One group of G members whose first tokens are alike (a shared turn)",
            "",
            "`x alone`: against LongStraw replaying (and scoring) every member from the prompt.",
            "",
            "| model | G | R | alike | run | peak GiB | x alone | replay GiB added | update s | x alone |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for k, row in sorted(
            trees.items(), key=lambda item: (item[0][:2], item[0][2] != "stock-serialized", not item[0][5])
        ):
            preset, length, mode, _, shared, spans = k
            alone = trees.get((preset, length, "longstraw-exact", None, shared, False), {})
            run = RUNS[mode] + ("" if mode == "stock-serialized" else ", spans shared" if spans else ", each alone")
            lines.append(_line(row, alone, [preset, str(row.get("G", "")), str(length), str(shared), run]))
    return "\n".join(lines) + "\n"


RUNS = {"stock-serialized": "stock (checkpointing)", "longstraw-exact": "LongStraw exact"}


def _line(row: dict, against: dict, cells: list[str]) -> str:
    if row.get("status") != "ok":
        return "| " + " | ".join(cells + [str(row.get("status")), "", "", "", ""]) + " |"
    peak, seconds = row["update_peak_bytes"] / GIB, row["update_time_s"]
    added = row.get("telemetry", {}).get("longstraw/replay/rss_added_gib")
    peak_ratio = time_ratio = ""
    if against.get("status") == "ok":
        peak_ratio = f"{row['update_peak_bytes'] / against['update_peak_bytes']:.2f}"
        time_ratio = f"{seconds / against['update_time_s']:.2f}"
    added = "" if added is None else f"{added:.3f}"
    return "| " + " | ".join(cells + [f"{peak:.3f}", peak_ratio, added, f"{seconds:.1f}", time_ratio]) + " |"


def _order(k: tuple) -> tuple:
    preset, length, mode, segment = k[:4]
    return preset, length, mode != "stock-serialized", segment is not None, segment or 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", type=lambda s: s.split(","), default=["dense-tiny", "hybrid-gdn-tiny"])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    parser.add_argument("--segment-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    parser.add_argument("--whole-up-to", type=int, default=16384, help="longest R replayed whole")
    parser.add_argument("--stock-up-to", type=int, default=16384, help="longest R run by stock")
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    parser.add_argument("--tree", action="store_true", help="the shared-prefix runs instead of the segment grid")
    parser.add_argument("--group-size", type=int, default=8, help="--tree: members per group")
    parser.add_argument("--shared-prefix", type=int, default=2048, help="--tree: the members' first tokens alike")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--time-cap-s", type=float, default=1800)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.json"
    data = json.loads(results.read_text()) if results.exists() else {"commands": [], "rows": []}
    if not args.report_only:
        data["commands"].append(" ".join(sys.argv[1:]))
        for _ in range(args.rounds):
            for config in configurations(args):
                row = run(config, args)
                print(
                    json.dumps(
                        {
                            k: row.get(k)
                            for k in ("preset", "R", "mode", "segment", "status", "update_time_s", "update_peak_bytes")
                        }
                    ),
                    flush=True,
                )
                data["rows"].append(row)
                results.write_text(json.dumps(data, indent=1))
    (args.out / "summary.md").write_text(summary(data["rows"], data["commands"]))


if __name__ == "__main__":
    main()
