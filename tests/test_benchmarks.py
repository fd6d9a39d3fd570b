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
