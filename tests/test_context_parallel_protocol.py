"""The rank protocol (`trl_longstraw/context_parallel/protocol.py`): one encode, one decode, and a mismatch between
ranks raises on every rank instead of hanging in mismatched collectives."""

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trl_longstraw.context_parallel import (
    Announcement,
    ContextParallelError,
    ContextParallelGroup,
    Phase,
    check_protocol,
)


@dataclass(frozen=True)
class AnnouncementWithOneMoreField(Announcement):
    """What another version of the protocol might send: one field more."""

    chunk_index: int = 0


def test_an_announcement_decodes_to_what_was_encoded():
    sent = Announcement(Phase.RECOMPUTE, 3, (1, 8, 5, 16), 12, 40, 0.25, 4096, 50.0, torch.bfloat16, True, True, 7)
    wire = sent.encode(torch.device("cpu"))
    assert wire.shape == (Announcement.WIRE_SIZE,) and wire.dtype == torch.float64
    assert Announcement.decode(wire) == sent
    nothing = Announcement(Phase.END_OF_SHARD)  # None fields (no window, no soft-capping) survive too
    assert Announcement.decode(nothing.encode(torch.device("cpu"))) == nothing


def test_decode_refuses_an_announcement_another_protocol_encoded():
    wire = AnnouncementWithOneMoreField(Phase.CAPTURE, 1).encode(torch.device("cpu"))
    with pytest.raises(ContextParallelError, match="another version of trl_longstraw's rank protocol"):
        Announcement.decode(wire)
    with pytest.raises(ContextParallelError, match="another version"):
        Announcement.decode(wire[:-1])


def ranks_with_different_protocols(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cp = ContextParallelGroup.of()
        check_protocol(cp)  # the same protocol on both ranks: passes
        try:
            check_protocol(cp, AnnouncementWithOneMoreField if rank == 1 else Announcement)
            outcome = None
        except ContextParallelError as error:
            outcome = str(error)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as file:
            file.write(repr(outcome))
    finally:
        dist.destroy_process_group()


def test_ranks_running_different_protocols_all_raise_naming_the_fix(tmp_path):
    args = (2, str(tmp_path / "init"), str(tmp_path))
    mp.start_processes(ranks_with_different_protocols, args=args, nprocs=2, join=True, start_method="fork")
    for rank in range(2):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert "run different versions of trl_longstraw's rank protocol" in outcome, rank
        assert "install the same trl_longstraw on every node" in outcome, rank
