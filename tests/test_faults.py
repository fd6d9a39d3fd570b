"""Faults across ranks (`trl_longstraw/faults.py`): a rank that raises, is killed or stalls at any point of the
context-parallel protocol makes every other rank of its group raise within the group's timeout, naming the phase and
what the faulty rank did. Each rank is its own process (forked: `tests/fault_worker.py`)."""

import contextlib
import copy
import dataclasses
import json
import os
import signal
import subprocess
import time

import pytest
import torch
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.accounting import UpdateSetup
from trl_longstraw.faults import REPORT_GRACE_S, NonFiniteWarning, PhaseOutOfMemoryError, current_phase, in_phase
from trl_longstraw.plan import GIB, explain_out_of_memory, load_model_config, plan_run

from .conftest import grads_of, make_trainer, synthetic_inputs
from .fault_worker import PHASES, run
from .launch import fork_ranks, ranks_command, worker_env

TIMEOUT_S = 4.0  # the group's timeout (the Trainer's ddp_timeout)
SLACK_S = 3.0  # the faulty rank's peers may enter their blocking collective a little after the fault
FAULTS = ("raise", "kill", "stall")
CASES = [(2, phase, fault) for phase in PHASES for fault in FAULTS]
CASES += [(3, "capture", "raise"), (3, "replay", "kill"), (3, "prompt_backward", "stall")]
CPU_ALLOCATOR_FAILURE = "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes."


def launch(tmp_path, world_size, phase, fault, faulty_rank):
    """Fork the ranks; wait for the survivors (every rank but a stalled one) up to their bound; kill what is left.
    Each rank's recorded outcome, the fault's time, and the exit codes."""
    args = (world_size, str(tmp_path / "init"), str(tmp_path), phase, fault, faulty_rank, TIMEOUT_S)
    context = fork_ranks(run, args, world_size, join=False)
    survivors = [rank for rank in range(world_size) if not (fault == "stall" and rank == faulty_rank)]
    deadline = time.monotonic() + 120  # the update itself, then the fault's bound: a hang fails the test here
    try:
        while time.monotonic() < deadline:
            if all(context.processes[rank].exitcode is not None for rank in survivors):
                break
            time.sleep(0.1)
    finally:
        for process in context.processes:
            if process.exitcode is None:
                process.kill()
            process.join()
    outcomes = {}
    for rank in range(world_size):
        path = tmp_path / f"rank{rank}.json"
        outcomes[rank] = json.loads(path.read_text()) if path.exists() else None
    fault_time = json.loads((tmp_path / "fault.json").read_text())["time"]
    return outcomes, fault_time, {rank: context.processes[rank].exitcode for rank in survivors}


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "phase", "fault"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_other_rank_raises_within_the_timeout_naming_the_phase_and_the_faulty_rank(
    tmp_path, world_size, phase, fault
):
    faulty = CASES.index((world_size, phase, fault)) % world_size  # the first rank as often as a later one
    outcomes, fault_time, exit_codes = launch(tmp_path, world_size, phase, fault, faulty)
    assert all(code != 0 for code in exit_codes.values()), exit_codes  # no survivor hung, none went on as if fine
    reported = {"raise": "raised ValueError: injected fault", "kill": "no report", "stall": "no report"}[fault]
    bound = (TIMEOUT_S if fault == "stall" else 0.0) + REPORT_GRACE_S + SLACK_S
    for rank, outcome in outcomes.items():
        if rank == faulty:
            if fault == "raise":  # the cause, as raised, noted with its phase
                assert (
                    outcome["error"] == "ValueError" and f"LongStraw phase {phase!r}, rank {rank}" in outcome["notes"]
                )
            continue
        assert outcome["error"] == "RankFailure", outcome
        assert f"in phase {phase!r} failed on rank {rank}" in outcome["message"], outcome["message"]
        assert f"rank {faulty}: {reported}" in outcome["message"], outcome["message"]
        assert outcome["time"] - fault_time <= bound, (outcome["time"] - fault_time, bound)


def test_the_phase_is_known_inside_it_and_an_error_leaving_it_is_noted():
    assert current_phase() == "outside a LongStraw phase"
    with pytest.raises(KeyError) as raised, in_phase("score"):
        assert current_phase() == "score"
        raise KeyError("x")
    assert raised.value.__notes__ == ["LongStraw phase 'score', rank 0"]
    assert current_phase() == "outside a LongStraw phase"


@pytest.mark.slow
def test_the_trainer_honours_ddp_timeout_when_a_context_parallel_rank_stalls(tmp_path):
    """`accelerate launch`, context_parallel_size=2, ddp_timeout=5: rank 1 stalls in the capture; rank 0's `train()`
    raises within the timeout, naming the phase and the silent rank."""
    env = worker_env()
    command = [*ranks_command(2), "-m", "tests.fault_worker", str(tmp_path), "5"]
    log = tmp_path / "launch.log"
    outcome = None
    with open(log, "w") as output:
        run = subprocess.Popen(command, env=env, stdout=output, stderr=output, start_new_session=True)
        try:  # until rank 0 has recorded how it ended (the stalled rank, deferring SIGTERM to its step's end as a
            # preempted rank does, would hold the launcher for its 30 s grace)
            deadline = time.monotonic() + 300
            while outcome is None and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):  # (being written)
                    outcome = json.loads((tmp_path / "rank0.json").read_text())
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                subprocess.run(["pkill", "-9", "-f", str(tmp_path)], check=False)
                run.wait()
    if outcome is None and (tmp_path / "rank0.json").exists():
        outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome is not None, log.read_text()[-4000:]
    fault_time = json.loads((tmp_path / "fault.json").read_text())["time"]
    assert outcome["error"] == "RankFailure", outcome
    assert "in phase 'capture' failed on rank 0 (timeout 5 s, the Trainer's `ddp_timeout`)" in outcome["message"]
    assert "rank 1: no report" in outcome["message"]
    assert outcome["time"] - fault_time <= 5 + REPORT_GRACE_S + SLACK_S


@pytest.mark.parametrize(
    "failure",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError(CPU_ALLOCATOR_FAILURE)],
    ids=["cuda", "cpu"],
)
def test_an_allocation_failure_names_the_phase_the_size_and_the_predicted_state(
    fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch, failure
):
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path)
    capture = trainer.engine.capture
    monkeypatch.setattr(trainer.engine, "capture", lambda *args, **kwargs: (capture(*args, **kwargs), fail())[0])

    def fail():
        raise failure

    with pytest.raises(PhaseOutOfMemoryError) as raised:
        trainer.replay_and_backward(trainer.model, synthetic_inputs(len(tokenizer)))
    message = str(raised.value)
    assert isinstance(raised.value, torch.OutOfMemoryError) and raised.value.__cause__ is failure
    assert "Out of memory in LongStraw phase 'capture': a prompt of P = 11 tokens, G = 3 completions" in message
    assert "prefill_chunk_size=1024, attention_chunk_size=4096, prompt_state_dtype='auto'" in message
    assert "MiB of prompt state on this rank (in the model's dtype, on the device)" in message
    assert "The plan fits: what it does not model took the rest" in message and f"(allocator: {failure})" in message


def test_the_explanation_lists_the_single_settings_that_would_fit():
    """Qwen3-8B, LoRA, P = 1M tokens on an 80 GiB device: the plan does not fit; each setting listed does."""
    config = load_model_config("qwen3_8b")
    setup = UpdateSetup(prompt_tokens=1_048_576, completion_tokens=1024, group_size=8, prefill_chunk_size=2048)
    message = explain_out_of_memory(config, setup, "capture", 1, 80 * GIB, 8)
    assert (
        "P = 1,048,576 tokens, G = 8 completions" in message and "Each of these settings alone would fit:" in message
    )
    suggested = [line.split(":")[0].strip() for line in message.splitlines() if line.startswith("  ")]
    assert "prompt_state_device='cpu'" in suggested and "context_parallel_size=4" in suggested, suggested
    for line in suggested:  # each, applied alone, fits by the plan
        key, value = line.split("=")
        value = eval(value)  # the message's own repr of a setting
        field = {"prompt_state_dtype": "state_dtype", "prompt_state_device": "state_device"}.get(key, key)
        cp = value if key == "context_parallel_size" else 1
        changed = setup if key == "context_parallel_size" else dataclasses.replace(setup, **{field: value})
        assert plan_run(config, changed, cp, 80 * GIB, 8, suggest=False).fits, line


def test_non_finite_values_are_named_and_the_step_goes_on_as_stocks(fresh_model, tokenizer, prompt_dataset, tmp_path):
    """A NaN embedding row that only group 1's member 1 reads: every phase that sees it warns naming itself, the first
    module whose output went non-finite and the optimizer step; the loss and which gradients are finite are stock's."""
    inputs = synthetic_inputs(len(tokenizer))
    poisoned = int(inputs["completion_ids"][4, 1])  # group 1, member 1, not used by any prompt of the batch
    assert poisoned not in inputs["prompt_ids"] and poisoned not in inputs["completion_ids"][:4]
    model = fresh_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[poisoned] = float("nan")
    stock = make_trainer(GRPOTrainer, copy.deepcopy(model), tokenizer, prompt_dataset, tmp_path / "stock")
    ours = make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path / "ours")
    want = stock.compute_loss(stock.model, inputs)
    want.backward()
    with pytest.warns(NonFiniteWarning) as warned:
        got = ours.replay_and_backward(ours.model, inputs)
    messages = [str(warning.message) for warning in warned]
    source = "optimizer step 1, the first non-finite output: the input embeddings)"
    assert f"the scored log-probs, group 1, member 1 (LongStraw phase 'score', {source}" in messages[0], messages
    assert any(f"the replayed log-probs, group 1, member 1 (LongStraw phase 'replay', {source}" in m for m in messages)
    # the reduced gradients, checked before the Trainer's clipping would spread the NaN to every one of them
    assert any(
        "in the gradients (optimizer step 1, the first non-finite output: the gradient of model." in m
        for m in messages
    )
    assert torch.isnan(got) == torch.isnan(want)
    finite = {name: bool(torch.isfinite(grad).all()) for name, grad in grads_of(ours.model).items()}
    assert finite == {name: bool(torch.isfinite(grad).all()) for name, grad in grads_of(stock.model).items()}


def test_a_non_finite_prompt_state_and_gradient_are_named(fresh_model, tokenizer, prompt_dataset, tmp_path):
    inputs = synthetic_inputs(len(tokenizer))
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path)
    with torch.no_grad():
        trainer.model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("inf")
    with pytest.warns(
        NonFiniteWarning,
        match=r"the captured prompt state \(LongStraw phase 'capture', optimizer step "
        r"1, the first non-finite output: decoder layer 1 \(AttentionPages\)\)",
    ):
        trainer.replay_and_backward(trainer.model, inputs)
    trainer.model.zero_grad()
    trainer.model.model.norm.weight.grad = torch.full_like(trainer.model.model.norm.weight, float("nan"))
    with pytest.warns(
        NonFiniteWarning,
        match=r"the gradients \(.*the first non-finite output: the gradient of "
        r"model.norm.weight\)",
    ):
        trainer._check_gradients()


def test_output_finiteness_names_the_first_module_and_its_hooks_can_be_removed():
    from trl_longstraw.embedded import build_model
    from trl_longstraw.faults import OutputFiniteness

    model = build_model("qwen3", seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    watch = OutputFiniteness.of_causal_lm(model)
    tokens = torch.tensor([[3, 7, 11]])
    with torch.no_grad():
        model(tokens)
    assert watch.first_non_finite() == "decoder layer 1"
    assert watch.first_non_finite() is None  # read and reset
    watch.remove()
    with torch.no_grad():
        model(tokens)
    assert watch.first_non_finite() is None  # no hook ran
