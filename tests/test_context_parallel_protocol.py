"""The rank protocol's version (`trl_longstraw/context_parallel/protocol.py`): a mismatch between ranks raises on every
rank instead of hanging in mismatched collectives."""

import os
from dataclasses import dataclass

import torch.distributed as dist

from trl_longstraw.context_parallel import ContextParallelError, ContextParallelGroup, check_protocol
from trl_longstraw.context_parallel.protocol import protocol_signature
from trl_longstraw.context_parallel.step import StepCall

from .launch import fork_ranks


@dataclass(frozen=True)
class StepCallWithOneMoreField(StepCall):
    """What another version of the protocol might send: one field more."""

    chunk_index: int = 0


def test_the_signature_follows_the_step_calls_fields():
    assert protocol_signature() == protocol_signature(StepCall)
    assert protocol_signature(StepCallWithOneMoreField) != protocol_signature()
    assert 0 < protocol_signature() < 2**48


def ranks_with_different_protocols(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cp = ContextParallelGroup.of()
        check_protocol(cp)  # the same protocol on both ranks: passes
        try:
            check_protocol(cp, protocol_signature(StepCallWithOneMoreField if rank == 1 else StepCall))
            outcome = None
        except ContextParallelError as error:
            outcome = str(error)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as file:
            file.write(repr(outcome))
    finally:
        dist.destroy_process_group()


def test_ranks_running_different_protocols_all_raise_naming_the_fix(tmp_path):
    args = (2, str(tmp_path / "init"), str(tmp_path))
    fork_ranks(ranks_with_different_protocols, args, 2)
    for rank in range(2):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert "run different versions of trl_longstraw's rank protocol" in outcome, rank
        assert "install the same trl_longstraw on every node" in outcome, rank
