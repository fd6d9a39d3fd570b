"""Every model type the registry accepts is verified against stock, or refused at construction naming the reason
(`tests/conformance.py`; `benchmarks/conformance.py` writes the table)."""

import pytest

from .conformance import EXACT_ONLY, accepted_model_types, conform

ACCEPTED = accepted_model_types()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ACCEPTED)
def test_every_accepted_model_type_is_verified_against_stock_or_refused(
    model_type, tokenizer, prompt_dataset, tmp_path
):
    result = conform(model_type, tokenizer, prompt_dataset, tmp_path)
    assert result["status"] in ("verified", EXACT_ONLY, "refused"), result
