"""Bounded broadcasts over one process group: the data link of the non-colocated transport, and
of a colocated refit with several trainer ranks.

Everything here is collective: call on every rank of the group, in the same order.

Timeouts: on CPU (gloo) every wait is ``Work.wait(timeout)``, in slices of the streams' peer watch
(``peers.interval_s``) that ask between them whether a peer process died; on GPU (NCCL) the host
waits for a CUDA event recorded after the collective (:meth:`DeviceStreams.host_wait`, which
asks the same). An NCCL collective that never completes stays queued on
its stream after our timeout: the process group is then unusable and must be torn down, and the
group's own timeout (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``), enforced by
NCCL's watchdog, must be at least ``refit.start_timeout_s`` or it aborts first.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_refit.control import is_gloo_timeout
from mcore_refit.processes import PeerWatch, Terminated
from mcore_refit.refit.errors import RefitError, RefitTimeout
from mcore_refit.refit.streams import DeviceStreams


@dataclass
class PendingTransfer:
    """Asynchronous broadcasts: the gloo works (CPU) or a CUDA event after all of them (GPU)."""

    works: list[dist.Work]
    done: torch.cuda.Event | None
    what: str

    def wait_host(self, streams: DeviceStreams, *, timeout_s: float) -> None:
        """Block the host until the transfer completed (bounded: ``timeout_s`` for all of it)."""
        if self.done is not None:
            streams.host_wait(self.done, timeout_s=timeout_s, what=self.what)
        deadline = time.monotonic() + timeout_s
        while self.works:
            _wait_work(self.works[0], deadline=deadline, timeout_s=timeout_s, what=self.what,
                       peers=streams.peers)
            self.works.pop(0)

    def wait_stream(self, streams: DeviceStreams, *, timeout_s: float) -> None:
        """Order the current stream after the transfer (GPU); block until done (CPU)."""
        if self.done is not None:
            streams.stream_wait(self.done)
        else:
            self.wait_host(streams, timeout_s=timeout_s)


class GroupCollectives:
    """Broadcasts over ``group`` with explicit group ranks and bounded waits.

    Collectives are issued through the group object's own methods, so ``group`` may be a group
    of the default world (``dist.new_group``, None for the world itself) or a standalone process
    group built from a store outside it (as non-colocated jobs do).
    """

    def __init__(self, *, group: dist.ProcessGroup | None, streams: DeviceStreams) -> None:
        if group is None:
            group = dist.group.WORLD
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this process is not a member of the refit process group")
        self.group = group
        self.streams = streams
        self.rank = group.rank()
        self.size = group.size()

    def broadcast_async(self, tensor: torch.Tensor, *, src_rank: int, what: str,
                        stream: torch.cuda.Stream | None = None,
                        done: torch.cuda.Event | None = None) -> PendingTransfer:
        """Start broadcasting ``tensor`` from group rank ``src_rank``.

        GPU: the broadcast is issued from ``stream`` (NCCL waits for the work queued there so
        far), and ``done`` is recorded on ``stream`` once NCCL finished (``work.wait()`` only
        orders the stream; the host never blocks here).
        """
        return _issue([self.broadcast_starter(tensor, src_rank=src_rank)],
                      streams=self.streams, what=what, stream=stream, done=done)

    def broadcast_starter(self, tensor: torch.Tensor, *, src_rank: int):
        """A call that starts broadcasting ``tensor`` from group rank ``src_rank`` and returns
        its ``Work``: for :func:`broadcast_to_each`, which starts several before waiting."""
        options = dist.BroadcastOptions()
        options.rootRank = src_rank
        return lambda: self.group.broadcast([tensor], options)

    def broadcast(self, tensor: torch.Tensor, *, src_rank: int, what: str,
                  timeout_s: float) -> None:
        self.broadcast_async(tensor, src_rank=src_rank, what=what).wait_host(
            self.streams, timeout_s=timeout_s)


def broadcast_to_each(links: Sequence[GroupCollectives], tensor: torch.Tensor, *, what: str,
                      stream: torch.cuda.Stream | None = None,
                      done: torch.cuda.Event | None = None) -> PendingTransfer:
    """Start broadcasting ``tensor`` from this rank over each of ``links`` at once (groups of one
    device's :class:`~mcore_refit.refit.streams.DeviceStreams`), as one transfer.

    GPU: every broadcast is issued from ``stream`` before ``stream`` waits for any of them, so
    each runs on its own communicator's stream beside the others (issued one after the other
    with :meth:`GroupCollectives.broadcast_async`, each would wait for the one before);
    ``done`` is recorded on ``stream`` once all finished.
    """
    if not links:
        raise ValueError(f"{what}: no link to broadcast over")
    return _issue([link.broadcast_starter(tensor, src_rank=link.rank) for link in links],
                  streams=links[0].streams, what=what, stream=stream, done=done)


def _issue(starts, *, streams: DeviceStreams, what: str, stream: torch.cuda.Stream | None,
           done: torch.cuda.Event | None) -> PendingTransfer:
    if not streams.is_cuda:
        return PendingTransfer(works=[start() for start in starts], done=None, what=what)
    done = done if done is not None else streams.new_event()
    with streams.use(stream):
        works = [start() for start in starts]
        for work in works:
            work.wait()
        streams.record(done)
    return PendingTransfer(works=[], done=done, what=what)


def _wait_work(work: dist.Work, *, deadline: float, timeout_s: float, what: str,
               peers: PeerWatch | None) -> None:
    """Wait for ``work`` until ``deadline`` (``time.monotonic()``), set ``timeout_s`` ago.

    With ``peers`` (a :class:`~mcore_refit.processes.PeerWatch`) the wait returns to Python every
    ``peers.interval_s``: a peer that died is named at once, even when this rank's own partner
    in the group lives on (and waits itself), and a stop signal that came meanwhile is raised
    (its handler runs only between C calls).
    """
    try:
        while True:
            left = deadline - time.monotonic()
            step = left if peers is None else min(left, peers.interval_s)
            try:
                # At least 1 ms: a zero timeout means no timeout to gloo.
                work.wait(timeout=datetime.timedelta(seconds=max(step, 1e-3)))
                return
            except RuntimeError as error:
                if not is_gloo_timeout(error):
                    raise RefitError(
                        f"{what} failed (a peer died or closed the group?): {error}") from None
            if time.monotonic() >= deadline:
                raise RefitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
            dead = peers.first_dead() if peers is not None else None
            if dead is not None:
                raise RefitError(f"{dead} while this rank waited for {what}")
    except Terminated as stopped:
        stopped.__context__ = None  # raised while a slice's timeout was handled: no failure
        raise
