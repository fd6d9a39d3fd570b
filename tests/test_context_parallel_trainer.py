"""The trainer with context_parallel_size=2 on 2 CPU ranks (gloo) takes the single-process optimizer step: same rows,
same loss, same grad norm, the same update of every weight, and bitwise the same weights on both ranks, in both
modes; then evaluates the eval set one process evaluates."""

import os
from types import SimpleNamespace

import pytest
import torch
from datasets import IterableDataset

from trl_longstraw.validation import check_eval_batches, check_eval_dataset

from .launch import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "context_parallel_trainer_worker.py")


# dense with tool calling (every rank runs the tools; the turns decode from the sharded state, each row's state
# extended over the group); MLA + DSA with IndexShare + MoE; MoE with the load-balancing loss (its prompt sums add up
# across the ranks); the last two with their members in segments, which the CP group runs in steps
FAMILIES = ["tool_calling", "glm_moe_dsa", "qwen3_moe"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every family on 2 CP ranks and in one process, each set of processes running them all (one launch)."""
    out = tmp_path_factory.mktemp("cp-trainer")
    run_ranks([WORKER, str(out), "2", *FAMILIES], alone=[WORKER, str(out), "1", *FAMILIES])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_context_parallel_ranks_take_the_single_process_step(results, family):
    single = torch.load(results / f"{family}-cp1-rank0.pt")
    ranks = [torch.load(results / f"{family}-cp2-rank{rank}.pt") for rank in range(2)]
    for mode in ("detach", "exact"):
        want = single[mode]
        for got in ranks:
            assert got[mode]["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
            assert got[mode]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            for name, update in want["update"].items():  # AdamW: compare updates at 1e-3 (docs/design.md)
                error = (got[mode]["update"][name] - update).norm() / update.norm().clamp(min=1e-12)
                assert error <= 1e-3, (mode, name, float(error))
            for name, update in got[mode]["update"].items():
                assert torch.equal(update, ranks[0][mode]["update"][name]), (mode, name)
            assert got[mode]["first_rows"] == ranks[0][mode]["first_rows"]  # the CP group draws one set of rows
            assert got[mode]["rollouts"] == want["rollouts"] >= 1  # decoded from the (sharded) prompt state
            assert got[mode]["tool_calls"] == want["tool_calls"]
            if family == "tool_calling":
                assert want["rollouts"] > 1 and want["tool_calls"] > 0  # tool turns, decoded from the state too
            else:
                assert want["rollouts"] == 1
            assert got[mode]["eval_prompts"] == want["eval_prompts"]  # every eval prompt, num_generations times
            assert got[mode]["eval_reward"] == pytest.approx(want["eval_reward"])
            for key in ("aux_loss", "eval_aux_loss"):
                assert (got[mode][key] is None) == (want[key] is None) == (family != "qwen3_moe"), (mode, key)
                if want[key] is not None:
                    assert got[mode][key] == pytest.approx(want[key], rel=1e-5), (mode, key)
        assert ranks[0][mode]["first_rows"] == want["first_rows"]


def test_eval_batches_under_context_parallelism_hold_whole_groups_and_end_full():
    """The ranks of a CP group must draw identical eval batches (`SharedRowsSampler`), refused otherwise with the fix."""
    args = SimpleNamespace(per_device_eval_batch_size=4, dataloader_drop_last=False)

    def check(num_prompts):
        check_eval_batches(num_prompts, 2, args, num_generations_eval=3)

    with pytest.raises(
        ValueError, match="per_device_eval_batch_size=4 to hold whole groups of num_generations_eval=3"
    ):
        check(4)
    args.per_device_eval_batch_size = 6
    with pytest.raises(ValueError, match="5 prompts x num_generations_eval=3 rows do not fill whole batches"):
        check(5)
    check(4)  # 12 rows: two full batches
    args.dataloader_drop_last = True
    check(5)  # the partial last batch is dropped on every rank
    iterable = IterableDataset.from_generator(lambda: iter([{"prompt": "a"}]))
    with pytest.raises(ValueError, match="iterable eval dataset.*Pass a map-style Dataset"):
        check_eval_dataset(iterable, 2, args, num_generations_eval=3)
