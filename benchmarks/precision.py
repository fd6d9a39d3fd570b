"""bf16 autocast against fp32, per family and gradient mode: LongStraw's gradient error next to the reference's own.

    PYTHONPATH=. .venv/bin/python benchmarks/precision.py

The test suite's tiny random models (every family of `trl_longstraw.embedded.FAMILIES`), one update of two groups of
3 (`tests/test_precision.py`'s shape), TRL's `dapo` loss. For each family and mode: the relative error (over every
parameter gradient at once) of LongStraw's bf16 gradient and of the reference's own bf16 gradient, both against the
reference's fp32 gradient. Exact mode's reference is stock `GRPOTrainer`, detach mode's the detached reference.
`tests/test_precision.py` asserts LongStraw's error is at most twice the reference's.
"""

import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from tests.reference import DetachedReferenceTrainer
from tests.test_precision import relative_error, update_gradients
from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.embedded import FAMILIES, build_model, build_tokenizer


def main() -> None:
    root = Path(tempfile.mkdtemp())
    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["abc"] * 8})

    def fresh_model(model_type="qwen3", **_):
        path = root / model_type
        if not path.exists():
            build_model(model_type).save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path)

    print("| family | exact: LongStraw / stock bf16 error | detach: LongStraw / detached reference bf16 error |")
    print("| --- | ---: | ---: |")
    for family in FAMILIES:
        cells = []
        for mode, reference in (("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)):
            out = root / f"{family}-{mode}"
            common = (fresh_model, tokenizer, dataset)
            truth = update_gradients(reference, *common, out / "fp32", False, family)
            theirs = update_gradients(reference, *common, out / "bf16", True, family)
            ours = update_gradients(LongStrawGRPOTrainer, *common, out / "ours", True, family, prompt_gradient=mode)
            cells.append(f"{relative_error(ours, truth):.1e} / {relative_error(theirs, truth):.1e}")
        print(f"| {family} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
