"""Sweep driver: stock GRPOTrainer vs Prefix Grouper vs LongStraw on one GRPO update, each run in a fresh process.

    PYTHONPATH=. .venv/bin/python benchmarks/sweep.py --model-preset dense-tiny \
        --prompt-lengths 1024,2048,4096,8192 --group-sizes 8 --completion-length 128 --modes all \
        --time-cap-s 240 --budget-gib 16 --out benchmarks/results/cpu-2core

Each configuration runs `sys.executable benchmarks/update_worker.py ...` in a subprocess, under a watchdog that polls
the child's RSS (psutil) every `--poll-s` and kills it above `--budget-gib` (recorded `oom(budget)`) or past
`--time-cap-s` (recorded `timeout(cap)`). Failures are rows like any other, never dropped. Results accumulate in
`--out` (results.json is the source of truth; a configuration already there is not rerun unless `--rerun`), and
results.csv, the PNG plots and summary.md are regenerated from all rows after every run.

Extra grids: `--grid MODES:PS:GS` (repeatable), e.g. `--grid longstraw-detach:8192:2,4,8,16`.
Capacity: `--capacity --budget-gib 8 --capacity-modes stock-serialized,longstraw-detach` finds, per mode, the longest
P that completes within the budget and the time cap (doubling from `--capacity-start-p`, then bisection to
`--capacity-resolution` tokens, at most `--capacity-max-p`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from presets import PRESETS
from update_worker import GC_DEFAULT, MODES

GIB = 1024**3
FAIL_SKIPS = ("oom(budget)", "oom(alloc)", "oom(killed)", "timeout(cap)")
MODE_STYLE = {
    "stock-batched": ("tab:red", "o"),
    "stock-serialized": ("tab:orange", "s"),
    "prefix-grouper": ("tab:purple", "^"),
    "longstraw-detach": ("tab:green", "D"),
    "longstraw-exact": ("tab:blue", "v"),
    "reference": ("tab:gray", "x"),
}


def save_loglog(fig, ax, ylabel: str, title: str, path: Path) -> None:
    """Finish a log-log plot over the prompt length and write it."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length P (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def mode_list(text: str) -> list[str]:
    modes = list(MODES) if text == "all" else [m for m in text.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; modes: {MODES}")
    return modes


# ------------------------------------------------------------------------------------------------------------------
# One run in a fresh process, under the watchdog
# ------------------------------------------------------------------------------------------------------------------
def run_key(row: dict) -> tuple:
    return (
        row.get("kind", "sweep"),
        row.get("model"),
        row["mode"],
        row["P"],
        row["G"],
        row["R"],
        row.get("gc_request", "auto"),
        row.get("budget_gib"),
    )


def run_one(cfg: dict, args, logs: Path) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "update_worker.py"),
        "--mode",
        cfg["mode"],
        "--prompt-length",
        str(cfg["P"]),
        "--group-size",
        str(cfg["G"]),
        "--completion-length",
        str(cfg["R"]),
        "--gradient-checkpointing",
        cfg.get("gc_request", "auto"),
        "--seed",
        str(args.seed),
        "--beta",
        str(args.beta),
        "--loss-type",
        args.loss_type,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--prefill-chunk-size",
        str(args.prefill_chunk_size),
        "--attention-chunk-size",
        str(args.attention_chunk_size),
    ]
    cmd += ["--model-config", args.model_config] if args.model_config else ["--preset", args.model_preset]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.snapshot, str(ROOT), env.get("PYTHONPATH")]))
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    name = f"{cfg.get('kind', 'sweep')}-{cfg['mode']}-P{cfg['P']}-G{cfg['G']}-R{cfg['R']}-gc{cfg.get('gc_request')}"
    out_path, err_path = logs / f"{name}.out", logs / f"{name}.err"
    budget = args.budget_gib * GIB
    status, max_rss = None, 0
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        watched = psutil.Process(child.pid)
        while child.poll() is None:
            try:
                rss = watched.memory_info().rss + sum(c.memory_info().rss for c in watched.children(recursive=True))
            except psutil.Error:
                rss = 0
            max_rss = max(max_rss, rss)
            elapsed = time.perf_counter() - t0
            if rss > budget:
                status = "oom(budget)"
            elif elapsed > args.time_cap_s:
                status = "timeout(cap)"
            if status:
                child.send_signal(signal.SIGKILL)
                child.wait()
                break
            time.sleep(args.poll_s)
    wall = time.perf_counter() - t0
    row = None
    with open(out_path) as out:
        for line in reversed(out.read().splitlines()):
            if line.startswith("{"):
                try:
                    row = json.loads(line)
                    break
                except json.JSONDecodeError:
                    continue
    if row is None:
        row = {"mode": cfg["mode"], "P": cfg["P"], "G": cfg["G"], "R": cfg["R"]}
        if status is None:
            code = child.returncode
            status = "oom(killed)" if code in (-signal.SIGKILL, 137) else "error"
            tail = Path(err_path).read_text().strip().splitlines()[-3:]
            row["reason"] = f"exit {code}: " + " | ".join(tail)
        else:
            row["reason"] = (
                f"watchdog: RSS {max_rss / GIB:.2f} GiB > budget {args.budget_gib} GiB"
                if status == "oom(budget)"
                else f"watchdog: wall time > {args.time_cap_s} s"
            )
        row["status"] = status
    row.update(
        kind=cfg.get("kind", "sweep"),
        gc_request=cfg.get("gc_request", "auto"),
        budget_gib=args.budget_gib,
        time_cap_s=args.time_cap_s,
        wall_s=wall,
        watchdog_max_rss_bytes=max_rss,
        threads=args.threads,
        command=" ".join(shlex.quote(c) for c in cmd),
        log=str(out_path.relative_to(args.out)),
        longstraw_ref=args.longstraw_ref,
    )
    row.setdefault("model", args.model_config and Path(args.model_config).stem or args.model_preset)
    if "gradient_checkpointing" not in row:
        req = cfg.get("gc_request", "auto")
        row["gradient_checkpointing"] = GC_DEFAULT[cfg["mode"]] if req == "auto" else req == "on"
    return row


class Store:
    def __init__(self, args):
        self.args = args
        self.path = args.out / "results.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"meta": {}, "runs": []}
        self.data["meta"].setdefault("commands", [])
        if not args.report_only:
            self.data["meta"]["commands"].append(" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv))
        self.data["meta"].update(machine_info())

    def find(self, key):
        for row in self.data["runs"]:
            if run_key(row) == key:
                return row
        return None

    def add(self, row):
        key = run_key(row)
        self.data["runs"] = [r for r in self.data["runs"] if run_key(r) != key] + [row]
        self.save()

    def save(self):
        self.path.write_text(json.dumps(self.data, indent=1))
        write_reports(self.data, self.args)


def library_snapshot(ref: str) -> tuple[str | None, str]:
    """`git archive` of trl_longstraw at `ref` into /tmp (other people edit the working tree while a sweep runs)."""
    if ref == "worktree":
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "trl_longstraw"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
        return None, f"worktree at {head[:12]}{' (dirty)' if dirty else ''}"
    commit = subprocess.run(
        ["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    target = Path(f"/tmp/trl_longstraw-snapshot-{commit[:12]}")
    if not (target / "trl_longstraw").exists():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", commit, "trl_longstraw"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return str(target), f"git {commit[:12]} (snapshot {target})"


def machine_info() -> dict:
    import torch

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def execute(cfg: dict, args, store: Store, logs: Path) -> dict:
    cfg = dict(cfg)
    cfg.setdefault("model", args.model_config and Path(args.model_config).stem or args.model_preset)
    cfg["budget_gib"] = args.budget_gib
    existing = store.find(run_key(cfg))
    if existing is not None and not args.rerun:
        print(f"  (have) {cfg['mode']:<17} P={cfg['P']:<6} G={cfg['G']:<3} {existing['status']}", flush=True)
        return existing
    print(f"  run    {cfg['mode']:<17} P={cfg['P']:<6} G={cfg['G']:<3} ...", end=" ", flush=True)
    row = run_one(cfg, args, logs)
    peak = row.get("peak_bytes")
    print(
        f"{row['status']:<13} wall {row['wall_s']:7.1f}s"
        + (
            f"  time {row['time_s']:7.2f}s  peak {peak / GIB:6.3f} GiB"
            if peak is not None
            else f"  ({row.get('reason', '')[:90]})"
        ),
        flush=True,
    )
    store.add(row)
    return row


# ------------------------------------------------------------------------------------------------------------------
# Sweep and capacity
# ------------------------------------------------------------------------------------------------------------------
def sweep(args, store: Store, logs: Path) -> None:
    grids = [(args.modes, args.prompt_lengths, args.group_sizes)] if args.modes else []
    for spec in args.grid or []:
        modes, ps, gs = spec.split(":")
        grids.append((mode_list(modes), int_list(ps), int_list(gs)))
    for modes, prompt_lengths, group_sizes in grids:
        for mode in modes:
            for G in group_sizes:
                failed = None
                for P in sorted(prompt_lengths):
                    cfg = {
                        "kind": "sweep",
                        "mode": mode,
                        "P": P,
                        "G": G,
                        "R": args.completion_length,
                        "gc_request": args.gradient_checkpointing,
                    }
                    if failed and not args.no_skip:
                        cfg["model"] = args.model_config and Path(args.model_config).stem or args.model_preset
                        cfg["budget_gib"] = args.budget_gib
                        if store.find(run_key(cfg)) is None:
                            row = dict(
                                cfg,
                                status="not_run",
                                reason=f"{failed[1]} at P={failed[0]} (same mode, G)",
                                time_cap_s=args.time_cap_s,
                            )
                            print(f"  skip   {mode:<17} P={P:<6} G={G:<3} not_run ({row['reason']})", flush=True)
                            store.add(row)
                        continue
                    row = execute(cfg, args, store, logs)
                    if row["status"] in FAIL_SKIPS:
                        failed = (P, row["status"])


def reuse_for_capacity(cfg: dict, args, store: Store) -> dict | None:
    """A sweep row of the same configuration that completed within this budget (absolute peak RSS, both the
    high-water mark and the watchdog's samples) and this time cap stands for a capacity probe: no rerun."""
    model = args.model_config and Path(args.model_config).stem or args.model_preset
    key = run_key(dict(cfg, model=model, budget_gib=args.budget_gib))
    if store.find(key) is not None:
        return None
    for row in store.data["runs"]:
        if (
            row.get("kind") == "sweep"
            and row.get("status") == "ok"
            and row.get("model") == model
            and (row["mode"], row["P"], row["G"], row["R"], row.get("gc_request", "auto"))
            == (cfg["mode"], cfg["P"], cfg["G"], cfg["R"], cfg["gc_request"])
            and max(row.get("peak_absolute_bytes", 0), row.get("watchdog_max_rss_bytes", 0)) <= args.budget_gib * GIB
            and row["wall_s"] <= args.time_cap_s
        ):
            return dict(
                row, kind="capacity", budget_gib=args.budget_gib, time_cap_s=args.time_cap_s, reused_from="sweep"
            )
    return None


def capacity(args, store: Store, logs: Path) -> None:
    G, R = args.capacity_group_size, args.completion_length
    saved_cap = args.time_cap_s
    args.time_cap_s = args.capacity_time_cap_s or args.time_cap_s
    try:
        for mode in args.capacity_modes:

            def probe(P, mode=mode):
                cfg = {
                    "kind": "capacity",
                    "mode": mode,
                    "P": P,
                    "G": G,
                    "R": R,
                    "gc_request": args.gradient_checkpointing,
                }
                reusable = reuse_for_capacity(cfg, args, store)
                if reusable is not None:
                    print(f"  reuse  {mode:<17} P={P:<6} G={G:<3} ok (sweep run within budget and cap)", flush=True)
                    store.add(reusable)
                    return True
                row = execute(cfg, args, store, logs)
                return row["status"] == "ok"

            print(f"capacity {mode} (budget {args.budget_gib} GiB, cap {args.time_cap_s} s, G={G})", flush=True)
            good, bad, P = None, None, args.capacity_start_p
            while True:
                if probe(P):
                    good = P
                    if P >= args.capacity_max_p:
                        break
                    P = min(2 * P, args.capacity_max_p)
                else:
                    bad = P
                    break
            while good is not None and bad is not None and bad - good > args.capacity_resolution:
                mid = (good + bad) // 2 // 256 * 256
                if mid <= good or mid >= bad:
                    break
                if probe(mid):
                    good = mid
                else:
                    bad = mid
    finally:
        args.time_cap_s = saved_cap


# ------------------------------------------------------------------------------------------------------------------
# Reports: CSV, plots, summary.md
# ------------------------------------------------------------------------------------------------------------------
CSV_FIELDS = [
    "kind",
    "model",
    "mode",
    "P",
    "G",
    "R",
    "gradient_checkpointing",
    "status",
    "reason",
    "time_s",
    "update_time_s",
    "optimizer_time_s",
    "update_cpu_s",
    "peak_gib",
    "update_peak_gib",
    "optimizer_peak_gib",
    "memory_metric",
    "durable_state_bytes",
    "baseline_gib",
    "watchdog_max_rss_gib",
    "grad_norm",
    "loss",
    "wall_s",
    "budget_gib",
    "time_cap_s",
    "threads",
    "loadavg_1m_start",
    "loadavg_1m_end",
    "phases_s",
    "log",
]


def gib(value):
    return None if value is None else value / GIB


def flat(row: dict) -> dict:
    out = {k: row.get(k) for k in CSV_FIELDS}
    out.update(
        peak_gib=gib(row.get("peak_bytes")),
        update_peak_gib=gib(row.get("update_peak_bytes")),
        optimizer_peak_gib=gib(row.get("optimizer_peak_bytes")),
        baseline_gib=gib(row.get("baseline_bytes")),
        watchdog_max_rss_gib=gib(row.get("watchdog_max_rss_bytes")),
    )
    if row.get("phases_s"):
        out["phases_s"] = ";".join(f"{k}={v:.3f}" for k, v in row["phases_s"].items())
    return out


def write_reports(data: dict, args) -> None:
    rows = data["runs"]
    with open(args.out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in sorted(rows, key=lambda r: (r.get("kind", ""), r["mode"], r["G"], r["P"])):
            writer.writerow(flat(row))
    try:
        plots(rows, args)
    except Exception as error:  # noqa: BLE001 - a plotting problem must not lose the results
        print(f"  (plots failed: {type(error).__name__}: {error})", flush=True)
    (args.out / "summary.md").write_text(summary(data, args))


def ok_rows(rows, **match):
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def default_gc(row) -> bool:
    return row.get("gc_request", "auto") == "auto"


def plots(rows, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep_rows = [r for r in rows if r.get("kind", "sweep") == "sweep" and default_gc(r)]
    Gp, Pr = args.plot_group_size, args.reference_p
    # 1. peak memory vs P, log-log, one line per mode at G = plot_group_size; failures marked at the bottom
    fig, ax = plt.subplots(figsize=(7, 5))
    for mode in MODES:
        pts = sorted((r["P"], r["peak_bytes"] / GIB) for r in ok_rows(sweep_rows, mode=mode, G=Gp))
        color, marker = MODE_STYLE[mode]
        if pts:
            ax.plot(*zip(*pts), marker=marker, color=color, label=mode)
        for r in sweep_rows:
            if r["mode"] == mode and r["G"] == Gp and r.get("status") != "ok":
                ax.annotate(
                    f"{mode}: {r['status']}",
                    xy=(r["P"], 0.02),
                    xycoords=("data", "axes fraction"),
                    color=color,
                    fontsize=7,
                    rotation=90,
                    va="bottom",
                )
    save_loglog(
        fig,
        ax,
        "peak memory of the update (GiB)\nCPU: process peak RSS above pre-update baseline",
        f"Peak memory vs P (G={Gp}, R={args.completion_length})",
        args.out / "memory_vs_P.png",
    )
    # 2. time vs P
    fig, ax = plt.subplots(figsize=(7, 5))
    for mode in MODES:
        pts = sorted((r["P"], r["time_s"]) for r in ok_rows(sweep_rows, mode=mode, G=Gp))
        if pts:
            color, marker = MODE_STYLE[mode]
            ax.plot(*zip(*pts), marker=marker, color=color, label=mode)
    save_loglog(
        fig,
        ax,
        "update + optimizer step wall time (s)",
        f"Time vs P (G={Gp}, R={args.completion_length})",
        args.out / "time_vs_P.png",
    )
    # 3. time vs G at P = reference_p
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for mode in MODES:
        rs = sorted(ok_rows(sweep_rows, mode=mode, P=Pr), key=lambda r: r["G"])
        if rs:
            color, marker = MODE_STYLE[mode]
            axes[0].plot([r["G"] for r in rs], [r["time_s"] for r in rs], marker=marker, color=color, label=mode)
            axes[1].plot(
                [r["G"] for r in rs], [r["peak_bytes"] / GIB for r in rs], marker=marker, color=color, label=mode
            )
    for ax, label in zip(axes, ("update + optimizer wall time (s)", "peak memory above baseline (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("group size G")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title(f"Time vs G (P={Pr})")
    axes[1].set_title(f"Peak memory vs G (P={Pr})")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "time_vs_G.png", dpi=120)
    plt.close(fig)
    # 4. phase breakdown, stacked bars, at (reference_p, plot_group_size)
    rs = [next(iter(ok_rows(sweep_rows, mode=m, P=Pr, G=Gp)), None) for m in MODES]
    rs = [r for r in rs if r is not None]
    if rs:
        phases = []
        for r in rs:
            phases += [p for p in r["phases_s"] if p not in phases]
        fig, ax = plt.subplots(figsize=(9, 5))
        bottom = [0.0] * len(rs)
        cmap = plt.get_cmap("tab20")
        for i, phase in enumerate(phases):
            vals = [r["phases_s"].get(phase, 0.0) for r in rs]
            ax.bar([r["mode"] for r in rs], vals, bottom=bottom, label=phase, color=cmap(i % 20))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("wall time (s)")
        ax.set_title(f"Phase breakdown (P={Pr}, G={Gp}, R={args.completion_length})")
        ax.legend(fontsize=8)
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
        fig.tight_layout()
        fig.savefig(args.out / "phases.png", dpi=120)
        plt.close(fig)


def _fmt(value, spec=".3f", none="-"):
    return none if value is None else format(value, spec)


def summary(data: dict, args) -> str:
    rows = data["runs"]
    sweep_rows = [r for r in rows if r.get("kind", "sweep") == "sweep"]
    defaults = [r for r in sweep_rows if default_gc(r)]
    Pr, Gp = args.reference_p, args.plot_group_size
    memory_label = next((r.get("memory_metric") for r in rows if r.get("memory_metric")), "peak_rss_above_baseline")
    lines = [f"# Update benchmark: {rows[0].get('model', '?') if rows else '?'}", ""]
    meta = data.get("meta", {})
    lines += (
        [
            (
                f"Machine: {meta.get('cpu_count')} CPUs, {meta.get('memory_gib')} GiB, torch {meta.get('torch')}, "
                f"{meta.get('platform')}. Threads per run: {args.threads or 'default'}."
            ),
            (
                f"Memory = `{memory_label}`: on CPU the process resident-set high-water (VmHWM, reset just before the "
                "update) minus the RSS right before it, for the update + one AdamW step; the budget watchdog polls the "
                "child's whole RSS. Time = wall time of the update + optimizer step (model build, trainer build and a "
                "tiny warm-up update excluded). One process per row."
            ),
            "",
            "Commands:",
            "",
        ]
        + [f"    {c}" for c in meta.get("commands", [])]
        + [""]
    )
    libraries = sorted(
        {(r.get("longstraw_path"), r.get("longstraw_sources_sha256")) for r in rows if r.get("longstraw_path")}
    )
    lines += [
        "trl_longstraw measured (package path, sha256 of its sources, per row in results.json): "
        + "; ".join(f"`{path}` {sha}" for path, sha in libraries),
        "",
    ]

    # Table at reference point
    lines += [
        f"## Peak and time per mode at P={Pr}, G={Gp}, R={args.completion_length}",
        "",
        (
            "| mode | grad ckpt | status | peak GiB | time s | update s | update CPU s | optimizer s | "
            "durable state MiB | grad norm | peak / stock-serialized | time / stock-serialized |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = next(iter(ok_rows(defaults, mode="stock-serialized", P=Pr, G=Gp)), None)
    for row in sorted([r for r in sweep_rows if r["P"] == Pr and r["G"] == Gp], key=lambda r: MODES.index(r["mode"])):
        ok = row.get("status") == "ok"
        ratio_m = ratio_t = None
        if ok and base:
            ratio_m, ratio_t = row["peak_bytes"] / base["peak_bytes"], row["time_s"] / base["time_s"]
        lines.append(
            f"| {row['mode']} | {'on' if row.get('gradient_checkpointing') else 'off'} | {row['status']} | "
            f"{_fmt(gib(row.get('peak_bytes')))} | {_fmt(row.get('time_s'), '.2f')} | "
            f"{_fmt(row.get('update_time_s'), '.2f')} | {_fmt(row.get('update_cpu_s'), '.2f')} | "
            f"{_fmt(row.get('optimizer_time_s'), '.3f')} | "
            f"{_fmt(row['durable_state_bytes'] / 2**20 if ok else None, '.1f')} | "
            f"{_fmt(row.get('grad_norm'), '.6f')} | "
            f"{_fmt(ratio_m, '.3f')} | {_fmt(ratio_t, '.3f')} |"
        )
    lines.append("")

    # Full sweep table
    lines += [
        "## All runs",
        "",
        "| kind | mode | P | G | grad ckpt | status | peak GiB | time s | state MiB | phases (s) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=lambda r: (r.get("kind", ""), MODES.index(r["mode"]), r["G"], r["P"])):
        ok = row.get("status") == "ok"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in (row.get("phases_s") or {}).items())
        lines.append(
            f"| {row.get('kind', 'sweep')} | {row['mode']} | {row['P']} | {row['G']} | "
            f"{'on' if row.get('gradient_checkpointing') else 'off'} | {row['status']} | "
            f"{_fmt(gib(row.get('peak_bytes')))} | {_fmt(row.get('time_s'), '.2f')} | "
            f"{_fmt(row['durable_state_bytes'] / 2**20 if ok else None, '.1f')} | {phases} | "
            f"{(row.get('reason') or '')[:80]} |"
        )
    lines.append("")

    # Growth G2 -> G8
    lines += [
        f"## Growth with G at P={Pr}",
        "",
        (
            "Memory increase G=2 -> G=8 as % of the G=8 peak; time per additional member = (t(G=8) - t(G=2)) / 6; "
            "where more G were run, the least-squares slope of time over G too."
        ),
        "",
        (
            "| mode | peak G=2 GiB | peak G=8 GiB | memory increase % of peak | time G=2 s | time G=8 s | "
            "s per extra member | fitted s per member (Gs) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES:
        two = next(iter(ok_rows(defaults, mode=mode, P=Pr, G=2)), None)
        eight = next(iter(ok_rows(defaults, mode=mode, P=Pr, G=8)), None)
        series = sorted(ok_rows(defaults, mode=mode, P=Pr), key=lambda r: r["G"])
        fit = None
        if len(series) >= 3:
            gs, ts = [r["G"] for r in series], [r["time_s"] for r in series]
            mg, mt = sum(gs) / len(gs), sum(ts) / len(ts)
            slope = sum((g - mg) * (t - mt) for g, t in zip(gs, ts)) / sum((g - mg) ** 2 for g in gs)
            fit = f"{slope:.3f} (G={','.join(map(str, gs))})"
        if not (two or eight):
            continue
        inc = per = None
        if two and eight:
            inc = 100 * (eight["peak_bytes"] - two["peak_bytes"]) / eight["peak_bytes"]
            per = (eight["time_s"] - two["time_s"]) / 6
        lines.append(
            f"| {mode} | {_fmt(gib(two and two['peak_bytes']))} | {_fmt(gib(eight and eight['peak_bytes']))} "
            f"| {_fmt(inc, '.1f')} | {_fmt(two and two['time_s'], '.2f')} | "
            f"{_fmt(eight and eight['time_s'], '.2f')} | {_fmt(per, '.3f')} | {fit or '-'} |"
        )
    lines.append("")

    # Floor
    detach = next(iter(ok_rows(defaults, mode="longstraw-detach", P=Pr, G=Gp)), None)
    small = sorted(ok_rows(defaults, mode="longstraw-detach", G=Gp), key=lambda r: r["P"])
    if detach and small:
        s0 = small[0]
        w, g, a = detach["weight_bytes"], detach["grad_bytes"], detach["adam_state_bytes"]
        graph = max(0, s0["peak_bytes"] - s0["durable_state_bytes"] - g - a)
        replay_peak = (s0.get("telemetry") or {}).get("longstraw/replay/peak_rss_gib")
        graph_replay = (
            None
            if replay_peak is None
            else max(0, replay_peak * GIB - s0["baseline_bytes"] - s0["durable_state_bytes"] - g)
        )
        floor = w + g + a + detach["durable_state_bytes"] + graph
        lines += [
            f"## Floor at P={Pr}, G={Gp}",
            "",
            (
                "floor = weights + grads + AdamW state (2 x params, fp32) + durable prompt state + one member's "
                f"replay graph. The replay graph is ESTIMATED from a measurement: the LongStraw detach peak above "
                f"baseline at the smallest P run (P={s0['P']}, G={Gp}) minus its durable state, minus grads and "
                "AdamW state (counted separately in the floor). It is an upper bound: it also holds that run's "
                "capture/scoring transients and allocator slack. Cross-check from the replay phase alone "
                "((replay-phase RSS high-water - baseline) - state - grads at that P): "
                f"{_fmt(gib(graph_replay), '.4f')} GiB."
            ),
            "",
            (
                f"- weights {w / 2**20:.1f} MiB, grads {g / 2**20:.1f} MiB, AdamW state {a / 2**20:.1f} MiB, "
                f"durable prompt state {detach['durable_state_bytes'] / 2**20:.1f} MiB, replay graph (est.) "
                f"{graph / 2**20:.1f} MiB -> floor {floor / GIB:.4f} GiB"
            ),
            "",
            "Measured peak for the ratio = peak above baseline + weights (the weights sit in the baseline).",
            "",
            "| mode | measured peak + weights GiB | / floor |",
            "| --- | --- | --- |",
        ]
        for mode in MODES:
            r = next(iter(ok_rows(defaults, mode=mode, P=Pr, G=Gp)), None)
            if r:
                m = r["peak_bytes"] + w
                lines.append(f"| {mode} | {m / GIB:.3f} | {m / floor:.2f} |")
        lines.append("")

    # Reference time
    ref = next(iter(ok_rows(defaults, mode="reference", P=Pr, G=Gp)), None)
    if ref:
        ref_t = ref["phases_s"]["prompt_forward"] + ref["phases_s"]["replays"]
        lines += [
            f"## Reference time at P={Pr}, G={Gp}",
            "",
            (
                "reference = one no-grad prompt forward into HF's DynamicCache (SDPA) + G replays (deep-copied cache, "
                "forward + backward each), measured in its own process (mode `reference`: the naive "
                "capture-and-replay on HF's own cache)."
            ),
            "",
            (
                f"- reference: prompt forward {ref['phases_s']['prompt_forward']:.2f} s + {Gp} replays "
                f"{ref['phases_s']['replays']:.2f} s = {ref_t:.2f} s; peak {gib(ref['peak_bytes']):.3f} GiB; "
                f"grad norm {ref['grad_norm']:.6f}"
            ),
        ]
        for mode in ("longstraw-detach", "longstraw-exact"):
            r = next(iter(ok_rows(defaults, mode=mode, P=Pr, G=Gp)), None)
            if r:
                lines.append(
                    f"- {mode}: update {r['update_time_s']:.2f} s (step incl. optimizer {r['time_s']:.2f} s)"
                    f" = {r['update_time_s'] / ref_t:.2f}x the reference"
                )
        if base:
            lines.append(
                f"- reference vs stock-serialized: peak {ref['peak_bytes'] / base['peak_bytes']:.3f}x, "
                f"time {ref['time_s'] / base['time_s']:.3f}x"
            )
        lines.append("")

    # LongStraw telemetry per phase
    tele = [r for r in ok_rows(defaults, P=Pr, G=Gp) if r.get("telemetry")]
    if tele:
        lines += [
            f"## LongStraw phases at P={Pr}, G={Gp} (its own telemetry, flushed after the call)",
            "",
            (
                "Peak = the phase's highest sampled RSS minus the pre-update baseline (LongStraw's MemoryMeter resets "
                "no high-water mark)."
            ),
            "",
            "| mode | phase | time s | peak above baseline GiB |",
            "| --- | --- | --- | --- |",
        ]
        for r in tele:
            t = r["telemetry"]
            for phase in [k.split("/")[1] for k in t if k.endswith("/time_s")]:
                peak_key = next(
                    (k for k in t if k.startswith(f"longstraw/{phase}/") and k.endswith("_peak_gib")), None
                )
                peak = None if peak_key is None else (t[peak_key] * GIB - r["baseline_bytes"]) / GIB
                lines.append(f"| {r['mode']} | {phase} | {t[f'longstraw/{phase}/time_s']:.2f} | {_fmt(peak)} |")
            lines.append(f"| {r['mode']} | prompt state | - | {t.get('longstraw/prompt_state_gib', 0):.4f} |")
        lines.append("")

    # Non-default gradient checkpointing runs
    extra = [r for r in sweep_rows if not default_gc(r)]
    if extra:
        lines += [
            "## Runs with gradient checkpointing overridden",
            "",
            "| mode | P | G | grad ckpt | status | peak GiB | time s | phases (s) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in extra:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in (r.get("phases_s") or {}).items())
            lines.append(
                f"| {r['mode']} | {r['P']} | {r['G']} | {'on' if r.get('gradient_checkpointing') else 'off'}"
                f" | {r['status']} | {_fmt(gib(r.get('peak_bytes')))} | {_fmt(r.get('time_s'), '.2f')} | "
                f"{phases} |"
            )
        lines.append("")

    # Capacity
    cap_rows = [r for r in rows if r.get("kind") == "capacity"]
    if cap_rows:
        lines += [
            "## Capacity",
            "",
            (
                "Longest P completed within the RSS budget (watchdog on the child's whole RSS) and the time cap; "
                "doubling, then bisection."
            ),
            "",
            "| mode | budget GiB | G | time cap s | longest P ok | first P failed | failure | probes |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        best = {}
        for key in sorted({(r["mode"], r["budget_gib"], r["G"]) for r in cap_rows}):
            mode, budget, G = key
            rs = [r for r in cap_rows if (r["mode"], r["budget_gib"], r["G"]) == key]
            good = [r["P"] for r in rs if r["status"] == "ok"]
            bad = sorted((r["P"], r["status"]) for r in rs if r["status"] != "ok")
            longest = max(good) if good else None
            first_bad = next((b for b in bad if longest is None or b[0] > longest), None)
            best[key] = (longest, first_bad)
            probes = ", ".join(f"{r['P']}:{r['status']}" for r in sorted(rs, key=lambda r: r["P"]))
            lines.append(
                f"| {mode} | {budget} | {G} | {rs[0].get('time_cap_s')} | {longest or '-'} | "
                f"{first_bad[0] if first_bad else '-'} | {first_bad[1] if first_bad else '-'} | "
                f"{probes} |"
            )
        for (mode, budget, G), (longest, first_bad) in best.items():
            if mode.startswith("longstraw"):
                for stock in ("stock-serialized", "stock-batched"):
                    other = best.get((stock, budget, G))
                    if other and other[0] and longest:
                        bound = "" if (first_bad or other[1] is None) else " (LongStraw hit the P cap: lower bound)"
                        lines.append(
                            f"\nCapacity ratio {mode} / {stock} at {budget} GiB, G={G}: "
                            f"{longest / other[0]:.2f}x ({longest} / {other[0]}){bound}"
                        )
        lines.append("")
    lines += ["Plots: memory_vs_P.png, time_vs_P.png, time_vs_G.png, phases.png.", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", default="dense-tiny", choices=sorted(PRESETS))
    parser.add_argument("--model-config", default=None, help="JSON/YAML of Hub-style config kwargs (with model_type)")
    parser.add_argument("--prompt-lengths", type=int_list, default=int_list("1024,2048,4096,8192"))
    parser.add_argument("--group-sizes", type=int_list, default=int_list("2,8"))
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--modes", type=mode_list, default=None, help="comma list or 'all' (the main grid)")
    parser.add_argument("--grid", action="append", help="extra grid MODES:PS:GS, e.g. longstraw-detach:8192:2,4,16")
    parser.add_argument(
        "--gradient-checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: off except stock-serialized (on)",
    )
    parser.add_argument("--time-cap-s", type=float, default=240.0)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--poll-s", type=float, default=0.05)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP/MKL threads per run (0: library default). 1 by default: see benchmarks/README.md, 'Threads'",
    )
    parser.add_argument("--capacity", action="store_true")
    parser.add_argument("--capacity-modes", type=mode_list, default=mode_list("stock-serialized,longstraw-detach"))
    parser.add_argument("--capacity-group-size", type=int, default=8)
    parser.add_argument("--capacity-start-p", type=int, default=1024)
    parser.add_argument("--capacity-max-p", type=int, default=65536)
    parser.add_argument("--capacity-resolution", type=int, default=2048)
    parser.add_argument("--capacity-time-cap-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--prefill-chunk-size", type=int, default=2048)
    parser.add_argument("--attention-chunk-size", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--reference-p", type=int, default=8192, help="P of the summary tables and G plots")
    parser.add_argument("--plot-group-size", type=int, default=8, help="G of the P plots and summary tables")
    parser.add_argument("--no-skip", action="store_true", help="run larger P even after an OOM/timeout at smaller P")
    parser.add_argument("--rerun", action="store_true", help="rerun configurations already in results.json")
    parser.add_argument("--report-only", action="store_true", help="only regenerate CSV, plots and summary.md")
    parser.add_argument(
        "--longstraw-ref",
        default="HEAD",
        help="git ref of trl_longstraw to measure (exported to /tmp), or 'worktree' for the checkout",
    )
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    args.snapshot, library = (None, "-") if args.report_only else library_snapshot(args.longstraw_ref)
    store = Store(args)
    if not args.report_only:
        store.data["meta"].setdefault("longstraw", [])
        store.data["meta"]["longstraw"].append(library)
        print(f"trl_longstraw: {library}", flush=True)
    if not args.report_only:
        if args.modes or args.grid:
            sweep(args, store, logs)
        if args.capacity:
            capacity(args, store, logs)
    store.save()
    print(f"wrote {args.out}/results.json, results.csv, summary.md, *.png", flush=True)


if __name__ == "__main__":
    main()
