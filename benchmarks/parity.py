"""Measured parity of `replay_and_backward` with stock GRPOTrainer, per loss type, beta and gradient mode.

    PYTHONPATH=. .venv/bin/python benchmarks/parity.py

Uses the test suite's tiny random Qwen3 (fp32, 2 groups of 3, prompts of 11 and 7 tokens, ragged completions, old and
reference log-probs perturbed so that clipping is active). Exact mode is compared with stock `compute_loss().backward()`;
detach mode with DESIGN.md's detached reference (HF cache under no_grad, deep-copied per member).
"""

import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from tests.test_trainer import LOSS_TYPES, DetachedReferenceTrainer, run_pair
from trl_longstraw.embedded import build_model, build_tokenizer


def main() -> None:
    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["abc"] * 8})
    root = Path(tempfile.mkdtemp())

    def fresh_model(**_):
        path = root / "model"
        if not path.exists():
            build_model("qwen3").save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path)

    print(f"{'loss_type':<9} {'beta':>5} {'mode':<7} {'|loss diff|':>12} {'max rel grad err':>17}")
    for mode, reference in (("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)):
        for loss_type in LOSS_TYPES:
            for beta in (0.0, 0.04):
                out = root / f"{mode}-{loss_type}-{beta}"
                ref_loss, loss, ref_grads, grads = run_pair(
                    reference, fresh_model, tokenizer, dataset, out, loss_type=loss_type, beta=beta,
                    prompt_gradient=mode,
                )
                err = max(((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k in ref_grads)
                print(f"{loss_type:<9} {beta:>5} {mode:<7} {abs(loss - ref_loss).item():>12.2e} {err:>17.2e}")


if __name__ == "__main__":
    main()
