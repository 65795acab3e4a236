"""The control plane on 3 fresh gloo ranks: JSON and bytes round trips, outcomes raised on every
rank with the failing rank's traceback (root cause first), and bounded waits."""

from __future__ import annotations

import re
import time

from mcore_refit.control import ControlGroup, ControlTimeout, Outcome, RankFailure
from tests.ranks import run_ranks


def _round_trips(rank: int) -> dict:
    control = ControlGroup(None, timeout_s=20)
    sent = {"prompts": ["1+2=", "ü+ß="], "n": rank} if rank == 1 else None
    received = control.broadcast_json(sent, src=1, what="a command")
    gathered = control.all_gather_json({"rank": rank, "text": "x" * (10 ** rank)},
                                       what="the replies")
    empty = control.broadcast_bytes(b"" if rank == 0 else None, src=0, what="nothing")
    if rank == 0:
        control.send_json([1.5, None, "ok"], dst=2, what="a point-to-point message")
    point = control.recv_json(src=0, what="a point-to-point message") if rank == 2 else None
    only_rank_2 = control.any_true(rank == 2, what="a flag on rank 2")
    nowhere = control.any_true(False, what="a flag nowhere")
    control.barrier(what="the end")
    return {"received": received, "gathered": gathered, "empty": empty.decode(),
            "point": point, "any": [only_rank_2, nowhere]}


def test_json_and_bytes_reach_every_rank(tmp_path):
    results = run_ranks(_round_trips, 3, tmp_path, timeout_s=60)
    for rank, result in results.items():
        assert result["received"] == {"prompts": ["1+2=", "ü+ß="], "n": 1}, result
        assert result["gathered"] == [{"rank": r, "text": "x" * (10 ** r)} for r in range(3)]
        assert result["empty"] == ""
        assert result["point"] == ([1.5, None, "ok"] if rank == 2 else None)
        assert result["any"] == [True, False]


def _failing_step(rank: int) -> None:
    if rank == 1:
        raise ValueError("engine on rank 1 refused the weights")
    if rank == 0:
        raise ControlTimeout("timed out after 5 s waiting for rank 1's reply")
    return None


def _outcomes(rank: int) -> dict:
    control = ControlGroup(None, timeout_s=20)
    values = control.share_outcomes(Outcome.of(lambda: rank * 10), what="a good step",
                                    who="trainer rank")
    try:
        control.share_outcomes(Outcome.of(_failing_step, rank), what="the refit",
                               who="trainer rank")
    except RankFailure as failure:
        return {"values": values, "message": str(failure),
                "failed_ranks": [r for r, _ in failure.failures]}
    return {"values": values, "message": None}


def test_a_failure_is_raised_on_every_rank_root_cause_first(tmp_path):
    results = run_ranks(_outcomes, 3, tmp_path, timeout_s=60)
    for result in results.values():
        assert result["values"] == [0, 10, 20]
        message = result["message"]
        assert message.startswith("the refit failed on trainer rank 1: ValueError: engine on "
                                  "rank 1 refused the weights\nTraceback"), message
        assert "in _failing_step" in message  # the failing rank's own traceback travels
        assert message.endswith("; also failed: trainer rank 0 (ControlTimeout)"), message
        assert result["failed_ranks"] == [1, 0]


def _absent_peer(rank: int) -> dict:
    control = ControlGroup(None, timeout_s=3)
    if rank == 2:
        time.sleep(8)  # never joins the broadcast below in time
        return {"skipped": True}
    started = time.monotonic()
    try:
        control.broadcast_json({"op": "generate"} if rank == 0 else None, src=0,
                               what="trainer rank 0's command")
        control.barrier(what="every rank after the command")
    except ControlTimeout as error:
        return {"error": str(error), "elapsed_s": time.monotonic() - started}
    return {"error": None}


def test_waits_are_bounded_and_name_what_they_waited_for(tmp_path):
    results = run_ranks(_absent_peer, 3, tmp_path, timeout_s=60)
    for rank in (0, 1):
        assert results[rank]["error"].startswith("timed out after 3 s waiting for "), results
        assert "on the control group" in results[rank]["error"]
        assert results[rank]["elapsed_s"] < 8


def _a_peer_dies_elsewhere(rank: int) -> dict:
    import os
    import signal

    from mcore_refit.control import PeerDied

    control = ControlGroup(None, timeout_s=30)
    control.watch_peers(name_of=lambda r: f"trainer rank {r}", interval_s=0.5)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        time.sleep(8)  # alive, but in no collective: nothing breaks rank 0's wait
        return {"pid": os.getpid()}
    started = time.monotonic()
    try:
        control.recv_json(src=1, what="rank 1's reply")
    except PeerDied as error:
        return {"message": str(error), "seconds": time.monotonic() - started}
    return {"message": None}


def test_a_wait_names_a_dead_rank_it_does_not_wait_for_within_the_liveness_interval(tmp_path):
    results = run_ranks(_a_peer_dies_elsewhere, 3, tmp_path, timeout_s=60)
    assert results[2] is None
    assert results[1]["pid"] > 0
    message = results[0]["message"]
    assert message is not None and re.match(
        r"trainer rank 2 \(pid \d+ on \S+\) died while rank 0 of the control group waited for "
        r"rank 1's reply$", message), message
    assert results[0]["seconds"] < 3.0, results[0]
