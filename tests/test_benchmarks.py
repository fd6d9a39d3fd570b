"""Every benchmark script still imports: a library symbol renamed or removed breaks the script at its first line, not
only its published numbers (the scripts run outside the suite, for minutes to hours)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda path: path.name)
def test_benchmark_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings (presets, update_worker)
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)


def test_the_trl_suites_stand_in_tokenizer_decodes_the_ids_trls_tests_hard_code(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS.parent))
    from benchmarks.trl_suite import reference_tokenizer

    tokenizer = reference_tokenizer("Qwen/Qwen3-30B-A3B")
    call = [151657, 198, 4913, 606, 788, 330, 64648, 22785, 497, 330, 16370, 788, 5212, 64, 788, 220, 18, 11, 330, 65]
    call += [788, 220, 19, 11248, 151658, 151645]
    want = '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    assert tokenizer.decode(call) == want
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id) == (151669, 151645, 151643)
    assert tokenizer.decode(tokenizer("Done! wörld").input_ids) == "Done! wörld"
