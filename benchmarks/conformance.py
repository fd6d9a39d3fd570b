"""Conformance table: every model type the registry accepts, verified against stock or refused.

    PYTHONPATH=. .venv/bin/python benchmarks/conformance.py

Runs `tests/conformance.py`'s `conform` on every accepted model type (tiny configs shrunk from the default ones,
fp32, CPU): ladder level 2 (log-probs against the model's own forward), levels 3 and 4 in both gradient modes (exact
against stock `GRPOTrainer`, detach against the detached reference), `dapo` with `beta` 0.04. Writes
`benchmarks/results/conformance.md` (`--output`).
"""

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import transformers
from datasets import Dataset

from tests.conformance import accepted_model_types, conform
from trl_longstraw.embedded import build_tokenizer

HERE = Path(__file__).resolve().parent


def cell(result: dict, mode: str) -> str:
    if mode not in result:
        return "-"
    loss, grad = result[mode]
    return f"{loss:.1e}, {grad:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(HERE / "results" / "conformance.md"))
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["abc"] * 8})
    results = []
    for model_type in accepted_model_types():
        result = conform(model_type, tokenizer, dataset, Path(tempfile.mkdtemp()))
        print(model_type, result["status"], flush=True)
        results.append(result)
    counts = Counter(result["status"] for result in results)
    summary = (
        f"transformers {transformers.__version__}; {len(results)} model types whose default config the registry "
        "accepts; tiny configs shrunk from the default ones (`tests/conformance.py`), fp32, CPU. Level 2: largest "
        "|log-prob difference| between capture + score and the model's own forward. Levels 3/4: |loss difference| "
        "and the largest relative gradient error per tensor (below 1e-3 of the global norm against that floor), exact "
        "mode against stock `GRPOTrainer`, detach mode against the detached reference. `tests/test_conformance.py` "
        "asserts every status."
    )
    lines = [
        "# Conformance: every model type the registry accepts",
        "",
        "```",
        "PYTHONPATH=. .venv/bin/python benchmarks/conformance.py",
        "```",
        "",
        summary,
        "",
        "| status | model types |",
        "| --- | ---: |",
        *(f"| {status} | {count} |" for status, count in counts.most_common()),
        "",
        "| model_type | status | level 2 | exact: loss, grad | detach: loss, grad | detail |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for result in results:
        detail = result.get("detail", "")
        level2 = f"{result['level2']:.1e}" if "level2" in result else "-"
        lines.append(
            f"| `{result['model_type']}` | {result['status']} | {level2} | {cell(result, 'exact')} | "
            f"{cell(result, 'detach')} | {detail.replace('|', '/')} |"
        )
    Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
