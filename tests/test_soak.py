"""The soak benchmark, short (`benchmarks/soak.py`): 40 optimizer steps in each prompt-gradient mode, a child process
whose resident set the test samples from outside. After a 10-step warm-up the resident set must not grow by more than
2%, and no tensor, tensor with a `grad_fn` or hook may be alive at the end that was not alive at the end of warm-up: a
leaked autograd graph, prompt state or hook grows those counts by at least one per step.

The step-time ratio the benchmark also checks is not asserted here: a 40-step run has 7-step quarters, too few to
separate a slowdown from other work on shared cores (the 300-step run in docs/benchmarks.md checks it)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_soak_grows_neither_the_resident_set_nor_live_tensors_or_hooks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import soak

    argv = ["--steps", "40", "--warmup-fraction", "0.25", "--census-every", "10", "--eval-every", "20"]
    argv += ["--longstraw-ref", "worktree"]  # the code under test
    options = soak.parser().parse_args([*argv, "--out", str(tmp_path)])
    options.argv = argv
    results, _ = soak.run_soak(options)

    assert [r["mode"] for r in results] == ["detach", "exact"]
    for r in results:
        assert r["warmup_steps"] == 10 and r["steps"] == 40, r
        assert r["samples_after_warmup"] >= 20, r  # the parent saw the run (0.2 s samples, ~0.2-0.3 s steps)
        assert r["rss_growth_pct"] <= 2.0, soak.summary_line(r)
        growth = r["census_growth"]
        assert growth["tensors"] <= 0 and growth["tensors_with_grad_fn"] <= 0, soak.summary_line(r)
        assert growth["hooks"] <= 0, soak.summary_line(r)
        assert r["census_end"]["tensors_with_grad_fn"] == 0, r["census_end"]  # no graph outlives a step
    assert (tmp_path / "soak.json").exists() and "| exact |" in (tmp_path / "summary.md").read_text()
