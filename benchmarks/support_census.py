"""Census of transformers' causal LMs: which model types the state-kind registry maps, against the old allowlist.

    .venv/bin/python benchmarks/support_census.py

For every model type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: build its default config
(`AutoConfig.for_model(model_type)`, default sizes, on the meta device: no weights, no memory), run
`trl_longstraw.architectures.check_supported` on it, then `trl_longstraw.accounting.prompt_state_account`. Each type
runs in a worker process with a time limit (`--timeout`, seconds); a type that runs past it is killed and reported as
a time-out. A nonzero default `attention_dropout`, `router_jitter_noise` or `input_jitter_noise` (training
hyperparameters whose noise the engine refuses) is set to 0.0 first and the type is flagged.

Classes: `accepted` (every decoder layer maps to a registered state kind), `accepted, accounting crashed`
(`check_supported` accepted, `prompt_state_account` raised), `refused` (`UnsupportedModelError`, with
the first line of its reason), `error building` (the config or the model skeleton could not be built: transformers
raised, not trl_longstraw), `crash` (trl_longstraw raised something other than `UnsupportedModelError`), `timeout`.

"Accepted" means the registry maps every layer and the accounting runs: it is NOT a parity test (only the families
of `trl_longstraw.embedded.FAMILIES` are verified against stock GRPO, by `tests/test_families.py`).

Writes `benchmarks/results/support_census.md` (`--output`).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
OLD_ALLOWLIST = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "glm_moe_dsa")
NOISE_FIELDS = ("attention_dropout", "router_jitter_noise", "input_jitter_noise")  # per-forward noise: refused
NOTE = (
    "`accepted` means the state-kind registry maps every decoder layer of the default-config skeleton and the "
    "accounting runs. It is not itself a parity test: the conformance run (`benchmarks/conformance.py`, "
    "`benchmarks/results/conformance.md`) then verifies every accepted type against stock GRPO or refuses it at "
    "construction, naming the reason."
)


# -- worker: one process, one model type at a time ------------------------------------------------------------------
def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def where_raised(error: BaseException) -> str:
    """`config` / `skeleton` (transformers raised) or `trl_longstraw` (the library raised), from the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if f"{os.sep}trl_longstraw{os.sep}" in frame.filename]
    if not ours:
        return "config"
    return "skeleton" if ours[-1].name == "model_skeleton" else "trl_longstraw"


def short_path(filename: str) -> str:
    """`trl_longstraw/...` or `transformers/...`: the path from the package, not from this machine's root."""
    for package in ("trl_longstraw", "transformers", "torch"):
        marker = f"{os.sep}{package}{os.sep}"
        if marker in filename:
            return package + os.sep + filename.rsplit(marker, 1)[1]
    return filename


def traceback_lines(error: BaseException) -> list[str]:
    """The trl_longstraw frames of the traceback, the innermost frame, and the exception line."""
    frames = traceback.extract_tb(error.__traceback__)
    keep = [frame for frame in frames if f"{os.sep}trl_longstraw{os.sep}" in frame.filename]
    if frames and (not keep or keep[-1] is not frames[-1]):
        keep.append(frames[-1])
    lines = [f"{short_path(frame.filename)}:{frame.lineno} in {frame.name}: {frame.line}" for frame in keep]
    return [*lines, first_line(error)]


def census_one(model_type: str) -> dict:
    from transformers import AutoConfig

    from trl_longstraw.accounting import prompt_state_account
    from trl_longstraw.architectures import check_supported
    from trl_longstraw.state import UnsupportedModelError

    result: dict = {"model_type": model_type, "dropout_reset": False}
    start = time.perf_counter()
    try:
        config = AutoConfig.for_model(model_type)
        try:
            text_config = config.get_text_config()
        except ValueError:  # left to check_supported, which reads it too
            text_config = config
        for sub in {id(config): config, id(text_config): text_config}.values():
            for field in NOISE_FIELDS:
                if getattr(sub, field, 0.0):
                    setattr(sub, field, 0.0)
                    result["dropout_reset"] = True
        plans = check_supported(config)
        runs: list[list] = []
        for plan in plans:
            kinds = "+".join(kind.name for kind, _ in plan.kinds)
            if runs and runs[-1][0] == kinds:
                runs[-1][1] += 1
            else:
                runs.append([kinds, 1])
        totals = Counter()
        for kinds, count in runs:
            totals[kinds] += count
        result["kinds"] = ", ".join(f"{count} x {kinds}" for kinds, count in totals.items())
        result["status"] = "accepted"
        try:
            account = prompt_state_account(config)
            result["per_token"] = account.bytes_per_token()
            result["fixed"] = sum(part.layers * part.fixed for part in account.by_layer_type.values())
        except Exception as error:  # noqa: BLE001  (the registry accepted it, its accounting raised: a crash)
            result["status"] = "accepted, accounting crashed"
            result["detail"] = f"{result['kinds']}; prompt_state_account raised {first_line(error)}"
            result["traceback"] = traceback_lines(error)
    except UnsupportedModelError as error:
        result["status"] = "refused"
        result["detail"] = first_line(error)
    except Exception as error:  # noqa: BLE001  (a census records every failure)
        where = where_raised(error)
        result["status"] = "crash" if where == "trl_longstraw" else "error building"
        result["detail"] = f"{where}: {first_line(error)}"
        if where == "trl_longstraw":
            result["traceback"] = traceback_lines(error)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def worker() -> None:
    """Read model types from stdin, write one JSON result per line; stray prints of model code go to stderr."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    import trl_longstraw.architectures  # noqa: F401  (import once, before the first time limit)

    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        model_type = line.strip()
        if model_type:
            results.write(json.dumps(census_one(model_type)) + "\n")


# -- parent: time limits, restarts, the report -----------------------------------------------------------------------
class Worker:
    def __init__(self, log):
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=HERE.parent,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
            },
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.lines.get(timeout=300)
        if ready is None or not json.loads(ready).get("ready"):
            raise RuntimeError("the census worker failed to start")

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, model_type: str, timeout: float) -> dict | None:
        self.process.stdin.write(model_type + "\n")
        self.process.stdin.flush()
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return None if line is None else json.loads(line)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            break
        num_bytes /= 1024
    return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.3g} {unit}"


def run(model_types: list[str], timeout: float, log) -> list[dict]:
    results = []
    current = Worker(log)
    for index, model_type in enumerate(model_types):
        result = current.ask(model_type, timeout)
        if result is None:  # ran past the limit, or the worker died: restart it
            alive = current.process.poll() is None
            current.stop()
            result = {
                "model_type": model_type,
                "status": "timeout" if alive else "error building",
                "detail": f"over {timeout:g} s" if alive else "the worker process died",
            }
            current = Worker(log)
        results.append(result)
        print(f"[{index + 1}/{len(model_types)}] {model_type}: {result['status']}", file=sys.stderr, flush=True)
    current.stop()
    return results


def report(results: list[dict], causal_lm: dict[str, str], timeout: float) -> str:
    import torch
    import transformers

    by_status = Counter(result["status"] for result in results)
    accepted = [r["model_type"] for r in results if r["status"] == "accepted"]
    old = [t for t in OLD_ALLOWLIST if t in causal_lm]
    new = [t for t in accepted if t not in OLD_ALLOWLIST]
    lost = [t for t in old if t not in accepted]
    reset = [r["model_type"] for r in results if r.get("dropout_reset")]
    lines = [
        "# Support census: transformers causal LMs",
        "",
        "```",
        ".venv/bin/python benchmarks/support_census.py",
        "```",
        "",
        (
            f"transformers {transformers.__version__}, torch {torch.__version__}; every model type of "
            f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({len(results)}), default config, skeleton on the meta device, "
            f"{timeout:g} s per type."
        ),
        "",
        f"**Note:** {NOTE}",
        "",
        "| | model types |",
        "| --- | ---: |",
        f"| old allowlist ({', '.join(OLD_ALLOWLIST)}) | {len(old)} |",
        *(f"| {status} | {by_status.get(status, 0)} |" for status in ("accepted", "refused", "error building")),
        *(
            f"| {status} | {by_status[status]} |"
            for status in ("accepted, accounting crashed", "crash", "timeout")
            if by_status.get(status)
        ),
        f"| newly accepted (accepted, not in the old allowlist) | {len(new)} |",
        "",
        f"Newly accepted ({len(new)}): {', '.join(f'`{t}`' for t in new) or 'none'}.",
        "",
        f"Old allowlist types not accepted now: {', '.join(f'`{t}`' for t in lost) or 'none'}.",
        "",
        (
            f"Default `attention_dropout`, `router_jitter_noise` or `input_jitter_noise` set to 0.0 before the check "
            f"({len(reset)}): "
            f"{', '.join(f'`{t}`' for t in reset) or 'none'}."
        ),
        "",
        "Slowest: "
        + ", ".join(
            f"`{r['model_type']}` {r['seconds']:.1f} s"
            for r in sorted(results, key=lambda r: -r.get("seconds", 0.0))[:3]
            if "seconds" in r
        )
        + ".",
        "",
        "| model_type | causal LM class | status | layers by state kind / reason | prompt state (bf16) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for result in results:
        model_type = result["model_type"]
        status = result["status"] + (" (old allowlist)" if model_type in OLD_ALLOWLIST else "")
        detail = result.get("kinds") if result["status"] == "accepted" else result.get("detail", "")
        state = ""
        if "per_token" in result:
            state = f"{human_bytes(result['per_token'])}/token + {human_bytes(result['fixed'])} fixed"
        detail = (detail or "").replace("|", "\\|")
        if len(detail) > 300:
            detail = detail[:297] + "..."
        lines.append(f"| `{model_type}` | {causal_lm[model_type]} | {status} | {detail} | {state} |")
    crashes = [r for r in results if r.get("traceback")]
    if crashes:
        lines += ["", "## Crashes (trl_longstraw raised something other than UnsupportedModelError)", ""]
        for result in crashes:
            lines += [f"`{result['model_type']}`:", "", "```", *result["traceback"], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="model types (default: all of MODEL_FOR_CAUSAL_LM_MAPPING)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per model type")
    parser.add_argument("--output", default=str(HERE / "results" / "support_census.md"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    model_types = args.model_types or list(causal_lm)
    with tempfile.TemporaryFile("w+") as log:
        results = run(model_types, args.timeout, log)
    text = report(results, causal_lm, args.timeout)
    if not args.model_types:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    by_status = Counter(result["status"] for result in results)
    print(", ".join(f"{status}: {count}" for status, count in sorted(by_status.items())))
    print(f"old allowlist: {sum(t in causal_lm for t in OLD_ALLOWLIST)}; {NOTE}")
    new = [r["model_type"] for r in results if r["status"] == "accepted" and r["model_type"] not in OLD_ALLOWLIST]
    print(f"newly accepted ({len(new)}): {', '.join(new)}")
    for result in results:
        if result.get("traceback"):
            print(f"CRASH {result['model_type']}:\n  " + "\n  ".join(result["traceback"]))


if __name__ == "__main__":
    main()
