"""Bounded collectives over one process group, and the refit's start/finish exchanges.

Everything here is collective: call on every rank of the group, in the same order.

Timeouts: on CPU (gloo) every wait is ``Work.wait(timeout)``; on GPU (NCCL) the host polls a CUDA
event recorded after the collective. An NCCL collective that never completes stays queued on
its stream after our timeout: the process group is then unusable and must be torn down, and the
group's own timeout (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``), enforced by
NCCL's watchdog, must be at least ``refit.start_timeout_s`` or it aborts first.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_refit.refit.plan import RefitPlan, plan_from_json
from mcore_refit.refit.streams import DeviceStreams
from mcore_refit.refit.transport import RefitError, RefitTimeout

# Bytes of the error message that travels from the failing rank to all others.
MAX_MESSAGE_BYTES = 16384

FLAG_CHECKSUMS = 1
FLAG_VERIFY = 2


@dataclass
class PendingTransfer:
    """An asynchronous broadcast: the gloo work (CPU) or a CUDA event after it (GPU)."""

    work: dist.Work | None
    done: torch.cuda.Event | None
    what: str

    def wait_host(self, streams: DeviceStreams, *, timeout_s: float) -> None:
        """Block the host until the transfer completed (bounded)."""
        if self.done is not None:
            streams.host_wait(self.done, timeout_s=timeout_s, what=self.what)
        elif self.work is not None:
            _wait_work(self.work, timeout_s=timeout_s, what=self.what)
        self.work = None

    def wait_stream(self, streams: DeviceStreams, *, timeout_s: float) -> None:
        """Order the current stream after the transfer (GPU); block until done (CPU)."""
        if self.done is not None:
            streams.stream_wait(self.done)
        else:
            self.wait_host(streams, timeout_s=timeout_s)


class GroupCollectives:
    """Broadcast / all-reduce over ``group`` with explicit group ranks and bounded waits.

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

    def check_src(self, src_rank: int) -> None:
        if not 0 <= src_rank < self.size:
            raise ValueError(
                f"src_rank={src_rank} is not a rank of the refit group (size {self.size}); "
                "pass the sender's rank within the group, not its global rank"
            )

    def broadcast_async(self, tensor: torch.Tensor, *, src_rank: int, what: str,
                        stream: torch.cuda.Stream | None = None,
                        done: torch.cuda.Event | None = None) -> PendingTransfer:
        """Start broadcasting ``tensor`` from group rank ``src_rank``.

        GPU: the broadcast is issued from ``stream`` (NCCL waits for the work queued there so
        far), and ``done`` is recorded on ``stream`` once NCCL finished (``work.wait()`` only
        orders the stream; the host never blocks here).
        """
        options = dist.BroadcastOptions()
        options.rootRank = src_rank
        return self._issue(lambda: self.group.broadcast([tensor], options), what=what,
                           stream=stream, done=done)

    def send_async(self, tensor: torch.Tensor, *, dst_rank: int, what: str,
                   stream: torch.cuda.Stream | None = None,
                   done: torch.cuda.Event | None = None) -> PendingTransfer:
        """Start sending ``tensor`` to group rank ``dst_rank`` (see :meth:`broadcast_async`)."""
        return self._issue(lambda: self.group.send([tensor], dst_rank, 0), what=what,
                           stream=stream, done=done)

    def recv_async(self, tensor: torch.Tensor, *, src_rank: int, what: str,
                   stream: torch.cuda.Stream | None = None,
                   done: torch.cuda.Event | None = None) -> PendingTransfer:
        """Start receiving into ``tensor`` from group rank ``src_rank``."""
        return self._issue(lambda: self.group.recv([tensor], src_rank, 0), what=what,
                           stream=stream, done=done)

    def _issue(self, start, *, what: str, stream: torch.cuda.Stream | None,
               done: torch.cuda.Event | None) -> PendingTransfer:
        if not self.streams.is_cuda:
            return PendingTransfer(work=start(), done=None, what=what)
        done = done if done is not None else self.streams.new_event()
        with self.streams.use(stream):
            work = start()
            work.wait()
            self.streams.record(done)
        return PendingTransfer(work=None, done=done, what=what)

    def broadcast(self, tensor: torch.Tensor, *, src_rank: int, what: str,
                  timeout_s: float) -> None:
        self.broadcast_async(tensor, src_rank=src_rank, what=what).wait_host(
            self.streams, timeout_s=timeout_s)

    def all_reduce_sum(self, tensor: torch.Tensor, *, what: str, timeout_s: float) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        work = self.group.allreduce([tensor], options)
        if self.streams.is_cuda:
            work.wait()
            done = self.streams.new_event()
            self.streams.record(done)
            self.streams.host_wait(done, timeout_s=timeout_s, what=what)
        else:
            _wait_work(work, timeout_s=timeout_s, what=what)


class RefitExchange:
    """The small messages of a broadcast refit: plan, start check, final status.

    Buffers are allocated once, so a steady-state refit allocates no device memory here either.
    """

    def __init__(self, collectives: GroupCollectives, *, src_rank: int) -> None:
        collectives.check_src(src_rank)
        self._coll = collectives
        self._src = src_rank
        device = collectives.streams.device
        self._start_rows = torch.zeros(collectives.size, 4, dtype=torch.int64, device=device)
        self._status_rows = torch.zeros(collectives.size, 2, dtype=torch.int64, device=device)
        self._message = torch.zeros(MAX_MESSAGE_BYTES, dtype=torch.uint8, device=device)

    def share_plan(self, plan: RefitPlan | None, *, timeout_s: float) -> RefitPlan:
        """The sender's plan on every rank (``plan`` on the sender, ignored elsewhere)."""
        device = self._coll.streams.device
        is_src = self._coll.rank == self._src
        if is_src and plan is None:
            raise ValueError("the sender must pass its plan")
        payload = plan.to_json().encode() if is_src else b""
        length = torch.tensor([len(payload)], dtype=torch.int64).to(device)
        what = f"the refit plan from group rank {self._src}"
        self._coll.broadcast(length, src_rank=self._src, what=f"{what} (length)",
                             timeout_s=timeout_s)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if is_src
                else torch.empty(int(length.item()), dtype=torch.uint8, device=device))
        self._coll.broadcast(data, src_rank=self._src, what=what, timeout_s=timeout_s)
        if is_src:
            return plan
        return plan_from_json(bytes(data.cpu().numpy()).decode())

    def start(self, plan: RefitPlan, *, refit_index: int, flags: int,
              timeout_s: float) -> tuple[int, int]:
        """Check every rank holds ``plan``; returns the sender's ``(refit_index, flags)``.

        Raises :class:`RefitError` on every rank, naming the fingerprints, on a mismatch.
        """
        rows = torch.zeros_like(self._start_rows, device="cpu")
        word0, word1 = plan.fingerprint_words
        rows[self._coll.rank] = torch.tensor([word0, word1, refit_index, flags])
        self._start_rows.copy_(rows)
        self._coll.all_reduce_sum(
            self._start_rows, timeout_s=timeout_s,
            what=f"the start of a refit on all {self._coll.size} ranks of the refit group")
        table = self._start_rows.tolist()
        fingerprints = [tuple(row[:2]) for row in table]
        if len(set(fingerprints)) != 1:
            holders = ", ".join(
                f"group rank {r}{' (sender)' if r == self._src else ''}: "
                f"{_hex_words(fp)}" for r, fp in enumerate(fingerprints))
            raise RefitError(
                f"refit plan mismatch: the ranks hold different plans ({holders}); build the "
                "plan from the same weight specs and refit config on both sides, or take the "
                "sender's plan at prepare()"
            )
        return table[self._src][2], table[self._src][3]

    def finish(self, failure: str | None, *, refit_index: int, timeout_s: float) -> None:
        """Share every rank's outcome; raise :class:`RefitError` everywhere if any rank failed."""
        rows = torch.zeros_like(self._status_rows, device="cpu")
        message = (failure or "").encode()[-MAX_MESSAGE_BYTES:]
        rows[self._coll.rank] = torch.tensor([int(failure is not None), len(message)])
        self._status_rows.copy_(rows)
        what = f"the outcome of refit {refit_index} from all ranks of the refit group"
        self._coll.all_reduce_sum(self._status_rows, what=what, timeout_s=timeout_s)
        table = self._status_rows.tolist()
        failed = [r for r, row in enumerate(table) if row[0]]
        if not failed:
            return
        # The sender's own error explains a receiver's "the sender aborted"; prefer it.
        reporter = self._src if self._src in failed else failed[0]
        if self._coll.rank == reporter:
            staged = torch.zeros(MAX_MESSAGE_BYTES, dtype=torch.uint8)
            staged[:len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
            self._message.copy_(staged)
        self._coll.broadcast(self._message, src_rank=reporter, timeout_s=timeout_s,
                             what=f"the error message of group rank {reporter}")
        text = bytes(self._message.cpu()[:table[reporter][1]].numpy()).decode(errors="replace")
        role = "the sender" if reporter == self._src else "a receiver"
        others = f" (ranks {failed} failed)" if len(failed) > 1 else ""
        raise RefitError(
            f"refit {refit_index} failed on group rank {reporter} ({role}){others}: {text}"
        )


def _wait_work(work: dist.Work, *, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        text = str(error)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise RefitTimeout(
                f"timed out after {timeout_s:g} s waiting for {what}: {text}") from None
        raise RefitError(
            f"{what} failed (a peer died or closed the group?): {text}") from None


def _hex_words(words: tuple[int, int]) -> str:
    return "".join(w.to_bytes(8, "little", signed=True).hex() for w in words)[:16]
