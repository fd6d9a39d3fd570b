"""Every model type the registry accepts keeps the status recorded in `benchmarks/results/conformance.md`: verified
against stock, or refused at construction naming the reason (`tests/conformance.py`; `benchmarks/conformance.py`
writes the table). A type that falls from verified to refused fails here as surely as one that goes wrong."""

import re
from pathlib import Path

import pytest

from .conformance import accepted_model_types, conform

TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "conformance.md"


def recorded_statuses() -> dict[str, str]:
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", TABLE.read_text(), flags=re.MULTILINE)
    return dict(rows)


RECORDED = recorded_statuses()


def test_the_table_records_every_accepted_model_type():
    """The table's types are the ones the registry accepts (a skeleton of each of transformers' types, ~10 s: once,
    here, rather than at every collection), so each test below covers one accepted type."""
    assert sorted(RECORDED) == sorted(accepted_model_types()), "rerun `PYTHONPATH=. python benchmarks/conformance.py`"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(RECORDED))
def test_every_accepted_model_type_keeps_its_recorded_status(model_type, tokenizer, prompt_dataset, tmp_path):
    result = conform(model_type, tokenizer, prompt_dataset, tmp_path)
    assert result["status"] == RECORDED[model_type], result
