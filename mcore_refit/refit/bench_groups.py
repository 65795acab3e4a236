"""The refit benchmark's own collectives (driven by :mod:`mcore_refit.refit.bench`).

- :class:`BenchGroup`: barriers, per-tensor broadcasts, slowest-rank times, outcome flags and JSON
  gathers over the refit group, issued through the group object's own methods, so a standalone
  group (a :class:`~mcore_refit.distributed.SplitJob`'s refit group, unknown to
  ``torch.distributed``'s world) works as well as the default group;
- :class:`TrainerLockstep`: keeps the trainer ranks that only drain the Megatron export in step
  with the sender, refit by refit.

Every wait is bounded and names what it waited for.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from mcore_refit.refit.group import GroupCollectives
from mcore_refit.refit.streams import DeviceStreams


class BenchGroup:
    """Collectives over the refit ``group`` (None: the default group), sender at ``src_rank``.

    Every method but :meth:`synchronize` is a collective: call it on every rank of the group, in
    the same order.
    ``timeout_s`` bounds waits inside a measurement; ``start_timeout_s`` the barriers, where a
    rank may wait for the sender to finish a mode of its own (``export_alone``).
    """

    def __init__(self, group: dist.ProcessGroup | None, *, src_rank: int, device: torch.device,
                 timeout_s: float, start_timeout_s: float) -> None:
        self.device = torch.device(device)
        self.streams = DeviceStreams(self.device)
        self._coll = GroupCollectives(group=group, streams=self.streams)
        self._coll.check_src(src_rank)
        self.group = group
        self.src_rank = src_rank
        self.rank = self._coll.rank
        self.size = self._coll.size
        self.is_sender = self.rank == src_rank
        self._timeout_s = timeout_s
        self._start_timeout_s = start_timeout_s
        # One event, re-recorded for every in-order broadcast (no event per tensor).
        self._done = self.streams.new_event()

    def broadcast(self, tensor: torch.Tensor, *, what: str) -> None:
        """Broadcast from the sender; the host waits until it completed."""
        self._coll.broadcast(tensor, src_rank=self.src_rank, what=what, timeout_s=self._timeout_s)

    def broadcast_in_order(self, tensor: torch.Tensor, *, what: str) -> None:
        """Broadcast from the sender, ordered before later work on the current stream.

        GPU: the host does not wait (like ``dist.broadcast`` without ``async_op``); CPU: the
        host waits, bounded.
        """
        pending = self._coll.broadcast_async(tensor, src_rank=self.src_rank, what=what,
                                             done=self._done)
        pending.wait_stream(self.streams, timeout_s=self._timeout_s)

    def barrier(self, *, what: str) -> None:
        """Wait until every rank of the group got here (an all-reduce, bounded)."""
        token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._coll.all_reduce_sum(token, what=f"every rank of the refit group at {what}",
                                  timeout_s=self._start_timeout_s)

    def synchronize(self, *, what: str) -> None:
        """Wait for the device work queued on the current stream (bounded; no-op on CPU)."""
        self.streams.synchronize(timeout_s=self._timeout_s, what=what)

    def slowest(self, seconds: float, *, what: str) -> float:
        """The largest of every rank's ``seconds``."""
        return max(self._rows(seconds, dtype=torch.float64, what=what))

    def all_ok(self, ok: bool, *, what: str) -> bool:
        """True on every rank when ``ok`` is true on every rank."""
        return not any(self._rows(0 if ok else 1, dtype=torch.int64, what=what))

    def gather_json(self, payload: Any, *, what: str) -> list[Any]:
        """Every other rank's ``payload`` (JSON data) than the sender's, in group-rank order."""
        data = json.dumps(payload).encode()
        lengths = [int(n) for n in self._rows(len(data), dtype=torch.int64,
                                               what=f"the lengths of {what}")]
        table = torch.zeros(self.size, max(lengths), dtype=torch.uint8)
        table[self.rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        table = table.to(self.device)
        self._coll.all_reduce_sum(table, what=what, timeout_s=self._timeout_s)
        rows = table.cpu()
        return [json.loads(bytes(rows[rank, :lengths[rank]].numpy()).decode())
                for rank in range(self.size) if rank != self.src_rank]

    def _rows(self, value: float, *, dtype: torch.dtype, what: str) -> list[float]:
        """Every rank's ``value`` (a gather through a summed one-row-per-rank table)."""
        rows = torch.zeros(self.size, dtype=dtype)
        rows[self.rank] = value
        rows = rows.to(self.device)
        self._coll.all_reduce_sum(rows, what=what, timeout_s=self._timeout_s)
        return rows.cpu().tolist()


class TrainerLockstep:
    """Trainer ranks other than the sender drain the export while the sender refits.

    After every refit that iterates the export, trainer rank 0 (the sender) tells the others
    whether the mode goes on: a failed refit ends the mode on the refit group, and it must end
    it on the draining ranks too. Collective over the trainer ranks' default group: call
    :meth:`after_refit` on every trainer rank, once per refit.
    """

    def __init__(self, *, device: torch.device, timeout_s: float) -> None:
        self._coll = GroupCollectives(group=None, streams=DeviceStreams(device))
        self._flag = torch.zeros(1, dtype=torch.int64, device=device)
        self._timeout_s = timeout_s

    @property
    def is_sender(self) -> bool:
        return self._coll.rank == 0

    def after_refit(self, *, failed: bool, refit_index: int) -> bool:
        """Whether trainer rank 0's refit ``refit_index`` failed (its ``failed``), on every rank."""
        self._flag.fill_(int(failed))
        self._coll.broadcast(self._flag, src_rank=0, timeout_s=self._timeout_s,
                             what=f"trainer rank 0's outcome of refit {refit_index}")
        return bool(self._flag.item())

