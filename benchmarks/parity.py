"""Measured parity of `replay_and_backward` with stock GRPOTrainer, per loss type, beta and gradient mode.

    PYTHONPATH=. .venv/bin/python benchmarks/parity.py

Uses the test suite's tiny random models (every family of `trl_longstraw.embedded.FAMILIES`): fp32, 2 groups of 3,
prompts of 11 and 7 tokens, ragged completions, old and reference log-probs perturbed so that clipping is active.
Exact mode is compared with stock `compute_loss().backward()`; detach mode with the detached reference (HF cache
under no_grad, deep-copied per member). `--families` restricts the run.
"""

import argparse
import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from tests.conftest import max_relative_error
from tests.reference import LOSS_TYPES, DetachedReferenceTrainer, run_pair
from tests.test_families import KEY_BIAS, RECURRENT
from trl_longstraw.embedded import FAMILIES, build_model, build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    families = parser.parse_args().families.split(",")
    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["abc"] * 8})
    root = Path(tempfile.mkdtemp())

    def fresh_model(model_type="qwen3", **_):
        path = root / model_type
        if not path.exists():
            build_model(model_type).save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path)

    # Every loss type on the dense model; dapo with beta 0.04 on every other family (recurrent families' A_log/dt_bias
    # gradients are compared against a floor of 1e-3 of the global gradient norm, OPT's key bias against 1e-5 of it,
    # see tests/test_families.py).
    cases = [("qwen3", loss_type, beta) for loss_type in LOSS_TYPES for beta in (0.0, 0.04) if "qwen3" in families]
    cases += [(family, "dapo", 0.04) for family in families if family != "qwen3"]
    print(f"{'model':<12} {'loss_type':<9} {'beta':>5} {'mode':<7} {'|loss diff|':>12} {'max rel grad err':>17}")
    for mode, reference in (("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)):
        for model_type, loss_type, beta in cases:
            out = root / f"{mode}-{model_type}-{loss_type}-{beta}"
            ref_loss, loss, ref_grads, grads = run_pair(
                reference,
                fresh_model,
                tokenizer,
                dataset,
                out,
                model_type=model_type,
                loss_type=loss_type,
                beta=beta,
                prompt_gradient=mode,
            )
            floor_fraction = 1e-3 if model_type in RECURRENT else 1e-5 if model_type in KEY_BIAS else 0.0
            err = max_relative_error(grads, ref_grads, floor_fraction=floor_fraction)
            print(
                f"{model_type:<12} {loss_type:<9} {beta:>5} {mode:<7} "
                f"{abs(loss - ref_loss).item():>12.2e} {err:>17.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
