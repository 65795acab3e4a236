"""How a buffer reaches the inference ranks on other devices than its source
(``refit.transport.fanout``).

- ``broadcast``: one collective over the source's data group (the source, then every inference
  rank on another device). NCCL pipelines it along a chain, so every engine's ingress carries
  the whole model, but the engines also forward inside one kernel per source, and with several
  sources the chains of all of them share each engine (measured 1.21 × one engine's time for
  two engines at PP2 × VPP2 on H200s).
- ``relay``: the source sends each buffer to one inference rank, its *entry*, over a two-rank
  link; the entry forwards it to every other inference rank the source serves, each over its
  own link. A source's buffers take its receivers as entries in turn (offset by the source's
  rank, so that several sources start at different engines): the source's egress carries each
  of its buffers once, every engine's ingress the whole model once, and every engine's egress
  (K − 1) / K of it for K engines, all links busy at once.

A *link* is a two-rank process group for one direction of one pair of ranks of the job (a
broadcast from the sending end), so each direction has its own communicator and stream: NCCL
runs the operations of one communicator in order, and a pair's two directions would wait for
each other.
Links are named by control ranks (trainer ranks, then inference ranks): ``(from, to)``.

Every rank posts its operations in plan order, so the two ends of every link meet in the same
order. On a GPU the entry's forwards are queued on the slot's stream right behind the receive
(no host round trip); on the CPU (gloo) a forward may only start once the receive completed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_refit.control import ControlGroup
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan
from mcore_refit.refit.streams import DeviceStreams
from mcore_refit.refit.transports.collectives import GroupCollectives, PendingTransfer
from mcore_refit.refit.transports.non_colocated.placement import Placement

Link = tuple[int, int]


def entries(plan: RefitPlan, placement: Placement) -> list[int | None]:
    """Each buffer's entry (an inference rank's index), None for a source without remote
    receivers. A source's buffers take its remote receivers in turn, starting at the one its
    rank points to."""
    counts: dict[int, int] = {}
    result: list[int | None] = []
    for buffer in plan.buffers:
        receivers = placement.remote_receivers(buffer.source)
        turn = counts.get(buffer.source, 0)
        counts[buffer.source] = turn + 1
        result.append(receivers[(turn + buffer.source) % len(receivers)] if receivers else None)
    return result


class BroadcastFanout:
    """One broadcast per buffer over its source's data group (the source is group rank 0)."""

    name = "broadcast"

    def __init__(self, *, data_groups: dict[int, dist.ProcessGroup],
                 streams: DeviceStreams) -> None:
        self._groups = {source: GroupCollectives(group=group, streams=streams)
                        for source, group in data_groups.items()}

    def send(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
             what: str) -> PendingTransfer:
        return self._groups[buffer.source].broadcast_async(view, src_rank=0, stream=stream,
                                                            done=done, what=what)

    def receive(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
                what: str) -> PendingTransfer:
        return self._groups[buffer.source].broadcast_async(view, src_rank=0, stream=stream,
                                                            done=done, what=what)

    def forward(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream,
                what: str) -> list[PendingTransfer]:
        return []


class RelayFanout:
    """Each buffer to its entry over a link, and from there to the source's other remote
    inference rank(s); ``me`` is this rank's control rank, ``links`` its links by
    ``(from, to)`` control ranks."""

    name = "relay"

    def __init__(self, *, plan: RefitPlan, placement: Placement, me: int,
                 links: dict[Link, dist.ProcessGroup], streams: DeviceStreams) -> None:
        self._placement = placement
        self._me = me
        self._entries = entries(plan, placement)
        needed = [link for link in placement.relay_links() if me in link]
        missing = [link for link in needed if link not in links]
        if missing:
            raise ValueError(f"refit.transport.fanout=relay: {placement.name_of(me)} lacks the "
                             f"links {missing} (build the non-colocated job with fanout='relay')")
        self._links = {link: GroupCollectives(group=links[link], streams=streams)
                       for link in needed}
        # On the CPU a forward reads what the receive wrote: it waits for it on the host.
        self._streams = streams

    def entry(self, buffer: PlannedBuffer) -> int:
        """The control rank of ``buffer``'s entry."""
        return self._placement.control_rank(self._entries[buffer.index])

    def send(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
             what: str) -> PendingTransfer:
        link = self._links[(self._me, self.entry(buffer))]
        return link.broadcast_async(view, src_rank=link.rank, stream=stream, done=done,
                                    what=what)

    def receive(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
                what: str) -> PendingTransfer:
        entry = self.entry(buffer)
        sender = buffer.source if entry == self._me else entry
        link = self._links[(sender, self._me)]
        return link.broadcast_async(view, src_rank=1 - link.rank, stream=stream, done=done,
                                    what=what)

    def forward(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream,
                what: str) -> list[PendingTransfer]:
        """From the entry to the source's other remote receivers (nothing elsewhere). On a GPU
        queue it right behind the receive on ``stream``; on the CPU, once the receive is done."""
        if self.entry(buffer) != self._me:
            return []
        forwards = []
        for other in self.targets(buffer):
            link = self._links[(self._me, other)]
            forwards.append(link.broadcast_async(
                view, src_rank=link.rank, stream=stream,
                what=f"{what}, forwarded to {self._placement.name_of(other)}"))
        return forwards

    def targets(self, buffer: PlannedBuffer) -> Sequence[int]:
        """The control ranks ``buffer``'s entry forwards it to."""
        entry = self.entry(buffer)
        return [rank for r in self._placement.remote_receivers(buffer.source)
                if (rank := self._placement.control_rank(r)) != entry]


def check_same_fanout(control: ControlGroup, options: TransportOptions, *, name_of) -> None:
    """Every rank of the refit uses one fan-out, or ``ValueError`` on every rank naming each
    rank's (a mix would leave the ends of a buffer waiting on different groups). Collective over
    ``control``."""
    chosen = control.all_gather_json(options.fanout,
                                     what="every rank's refit.transport.fanout")
    if len(set(chosen)) > 1:
        ranks = ", ".join(f"{name_of(rank)}: {fanout}" for rank, fanout in enumerate(chosen))
        raise ValueError(f"refit.transport.fanout differs between the ranks of the refit "
                         f"({ranks}); give every rank the same")
