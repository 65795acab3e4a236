"""Broadcasts over several two-rank links at once (``broadcast_to_each``, the direct fan-out's
send) on CPU (gloo, 3 real processes): every receiver gets the bytes bitwise, and a receiver
that never takes part is a RefitTimeout naming the transfer after one ``timeout_s`` for all the
links together, not one per link.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mcore_refit.refit import RefitTimeout
from mcore_refit.refit.streams import DeviceStreams
from mcore_refit.refit.transports.collectives import GroupCollectives, broadcast_to_each
from tests.ranks import run_ranks

CPU = torch.device("cpu")
LATE_S = 3.0  # how long rank 1 takes to join the stalled transfer
TIMEOUT_S = 4.0


def to_each(rank: int) -> dict:
    """Rank 0 sends to ranks 1 and 2 over a link each, twice: both take part in the first, only
    rank 1 (late) in the second, while rank 2 stays away."""
    streams = DeviceStreams(CPU)
    groups = {1: dist.new_group([0, 1]), 2: dist.new_group([0, 2])}
    sent = [torch.arange(1000, dtype=torch.float32) * (i + 1) for i in range(2)]
    if rank == 0:
        links = [GroupCollectives(group=groups[r], streams=streams) for r in (1, 2)]
        broadcast_to_each(links, sent[0], what="buffer 0 to ranks 1, 2").wait_host(
            streams, timeout_s=30.0)
        stalled = broadcast_to_each(links, sent[1], what="buffer 1 to ranks 1, 2")
        started = time.monotonic()
        try:
            stalled.wait_host(streams, timeout_s=TIMEOUT_S)
            return {"error": None}
        except RefitTimeout as error:
            return {"error": str(error), "elapsed_s": time.monotonic() - started}
    link = GroupCollectives(group=groups[rank], streams=streams)
    received = torch.zeros(1000)
    link.broadcast(received, src_rank=0, what="buffer 0", timeout_s=30.0)
    out = {"first": torch.equal(received, sent[0])}
    if rank == 1:
        time.sleep(LATE_S)
        link.broadcast(received, src_rank=0, what="buffer 1", timeout_s=30.0)
        out["second"] = torch.equal(received, sent[1])
    else:  # alive but absent (a closed connection would be a RefitError, not a timeout)
        time.sleep(TIMEOUT_S + LATE_S + 5)
    return out


@pytest.mark.timeout(200)
def test_broadcast_to_each_reaches_every_link_and_times_out_once_for_all(tmp_path):
    results = run_ranks(to_each, 3, tmp_path, timeout_s=180)
    assert results[1] == {"first": True, "second": True}, results
    assert results[2] == {"first": True}, results
    sender = results[0]
    assert sender["error"] is not None, sender
    assert sender["error"].startswith(
        f"timed out after {TIMEOUT_S:g} s waiting for buffer 1 to ranks 1, 2"), sender
    # One deadline for both links: rank 1's late part does not extend the wait for rank 2.
    assert TIMEOUT_S - 0.1 <= sender["elapsed_s"] < TIMEOUT_S + LATE_S - 1.0, sender
