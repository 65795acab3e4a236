"""Broadcasts over several two-rank links at once (``broadcast_to_each``, the direct fan-out's
send) on CPU (gloo, 3 real processes): every receiver gets the bytes bitwise, and a receiver
that never takes part is a RefitTimeout naming the transfer after one ``timeout_s`` for all the
links together, not one per link; a process of the job that dies while the sender waits for a
receiver that lives on is named within the peer watch's interval.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mcore_refit.processes import PeerWatch, ProcessIdentity
from mcore_refit.refit import RefitError, RefitTimeout
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


DIES_AFTER_S = 1.0
INTERVAL_S = 0.25


def peer_dies(rank: int) -> dict:
    """Rank 0 broadcasts to rank 1, which stays away but alive; meanwhile a watched process of
    the job (here a child of rank 0, "trainer rank 2") exits."""
    if rank == 1:
        time.sleep(DIES_AFTER_S + 10)
        return {}
    started = time.monotonic()  # the victim cannot have died before this + DIES_AFTER_S
    victim = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({DIES_AFTER_S})"])
    watch = PeerWatch(peers=((2, "trainer rank 2", ProcessIdentity.of(victim.pid)),),
                      interval_s=INTERVAL_S)
    streams = DeviceStreams(CPU, peers=watch)
    link = GroupCollectives(group=dist.group.WORLD, streams=streams)
    try:
        link.broadcast(torch.ones(10), src_rank=0, what="buffer 0 to rank 1", timeout_s=60.0)
        return {"error": None}
    except RefitError as error:
        return {"error": str(error), "type": type(error).__name__,
                "elapsed_s": time.monotonic() - started, "pid": victim.pid}
    finally:
        victim.wait()


@pytest.mark.timeout(120)
def test_a_broadcast_wait_names_a_dead_peer_within_the_interval(tmp_path):
    sender = run_ranks(peer_dies, 2, tmp_path, timeout_s=100)[0]
    assert sender["type"] == "RefitError", sender
    assert sender["error"] == (f"trainer rank 2 (pid {sender['pid']} on {socket.gethostname()}) "
                               "died while this rank waited for buffer 0 to rank 1"), sender
    assert DIES_AFTER_S <= sender["elapsed_s"] < DIES_AFTER_S + INTERVAL_S + 2.0, sender
