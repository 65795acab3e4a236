"""Where a non-colocated job's ranks sit: which trainer and inference ranks share a device.

A pair that shares a device moves its buffers over the IPC hand-over; every other pair over the
source's broadcast group, or over two-rank links (``refit.transport.fanout``). Pure, the same on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a non-colocated job's ranks sit, the same on every rank.

    Job ranks are trainer ranks ``0 .. num_trainers-1`` then inference ranks; ``shared`` holds
    the ``(trainer rank, inference rank)`` pairs that share a device.
    """

    num_trainers: int
    num_receivers: int
    shared: frozenset[tuple[int, int]] = frozenset()

    def control_rank(self, receiver: int) -> int:
        return self.num_trainers + receiver

    def name_of(self, control_rank: int) -> str:
        if control_rank < self.num_trainers:
            return f"trainer rank {control_rank}"
        return f"inference rank {control_rank - self.num_trainers}"

    def ipc(self, source: int, receiver: int) -> bool:
        return (source, receiver) in self.shared

    def ipc_receivers(self, source: int) -> list[int]:
        return [r for r in range(self.num_receivers) if self.ipc(source, r)]

    def remote_receivers(self, source: int) -> list[int]:
        """The inference ranks ``source`` broadcasts to (group ranks 1.. of its data group)."""
        return [r for r in range(self.num_receivers) if not self.ipc(source, r)]

    def direct_links(self) -> list[tuple[int, int]]:
        """Every ``(from, to)`` pair of job ranks a direct refit moves buffers between (each
        source to each of its remote inference ranks), in one order for every rank."""
        return [(source, self.control_rank(receiver)) for source in range(self.num_trainers)
                for receiver in self.remote_receivers(source)]

    def relay_links(self) -> list[tuple[int, int]]:
        """Every ``(from, to)`` pair of job ranks a relay refit moves buffers between (each
        source to its remote inference ranks, and among those), in one order for every rank
        (see :mod:`mcore_refit.refit.transports.non_colocated.fanout`)."""
        links: list[tuple[int, int]] = []
        for source in range(self.num_trainers):
            receivers = [self.control_rank(r) for r in self.remote_receivers(source)]
            links += [(source, receiver) for receiver in receivers]
            links += [(entry, other) for entry in receivers for other in receivers
                      if other != entry]
        return list(dict.fromkeys(links))
