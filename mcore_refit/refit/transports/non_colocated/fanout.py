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
- ``direct``: the source sends each buffer to every inference rank it serves at once, each over
  its own link; nothing is forwarded. Every engine's ingress carries the whole model, from all
  sources in parallel, and each source's egress its own buffers once per engine: for K sources
  holding a K-th of the model each and K engines (PP2 × VPP2, TP2 or EP2 into two engines),
  every GPU sends or receives the bytes of a one-engine refit. With fewer sources than engines
  a source's egress is the bottleneck (one source into three engines sends the model three
  times): ``broadcast`` stays the default, and ``direct`` is meant for at least as many sources
  as engines.

A *link* is a two-rank process group for one direction of one pair of ranks of the job (a
broadcast from the sending end), so each direction has its own communicator and stream: NCCL
runs the operations of one communicator in order, and a pair's two directions would wait for
each other.
Links are named by control ranks (trainer ranks, then inference ranks): ``(from, to)``.

Every rank posts its operations in plan order, so the two ends of every link meet in the same
order. A send over several links (``direct``'s from a source, a relay entry's forwards) issues
all of them before its stream waits for any, so they run at once, one communicator each, and
the slot is refilled only once every one of them completed. On a GPU the entry's forwards are
queued on the slot's stream right behind the receive (no host round trip); on the CPU (gloo) a
forward may only start once the receive completed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_refit.control import ControlGroup
from mcore_refit.refit.config import Fanout, TransportOptions
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan
from mcore_refit.refit.streams import DeviceStreams
from mcore_refit.refit.transports.collectives import (
    GroupCollectives,
    PendingTransfer,
    broadcast_to_each,
)
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


class _LinkFanout:
    """What the fan-outs over two-rank links share: this rank's links (``me`` is its control
    rank, ``links`` its groups by ``(from, to)`` control ranks), checked against ``needed``."""

    name: str

    def __init__(self, *, placement: Placement, me: int, links: dict[Link, dist.ProcessGroup],
                 needed: Sequence[Link], streams: DeviceStreams) -> None:
        self._placement = placement
        self._me = me
        needed = [link for link in needed if me in link]
        missing = [link for link in needed if link not in links]
        if missing:
            raise ValueError(f"refit.transport.fanout={self.name}: {placement.name_of(me)} lacks "
                             f"the links {missing} (build the non-colocated job with "
                             f"fanout='{self.name}')")
        self._links = {link: GroupCollectives(group=links[link], streams=streams)
                       for link in needed}

    def _send_to(self, receivers: Sequence[int], view: torch.Tensor, *, stream, done,
                 what: str) -> PendingTransfer:
        """From this rank to each of ``receivers`` (control ranks) at once, as one transfer."""
        return broadcast_to_each([self._links[(self._me, to)] for to in receivers], view,
                                 stream=stream, done=done, what=what)

    def _receive_from(self, sender: int, view: torch.Tensor, *, stream, done,
                      what: str) -> PendingTransfer:
        link = self._links[(sender, self._me)]
        return link.broadcast_async(view, src_rank=1 - link.rank, stream=stream, done=done,
                                    what=what)


class RelayFanout(_LinkFanout):
    """Each buffer to its entry over a link, and from there to the source's other remote
    inference rank(s); ``me`` is this rank's control rank, ``links`` its links by
    ``(from, to)`` control ranks."""

    name = "relay"

    def __init__(self, *, plan: RefitPlan, placement: Placement, me: int,
                 links: dict[Link, dist.ProcessGroup], streams: DeviceStreams) -> None:
        super().__init__(placement=placement, me=me, links=links,
                         needed=placement.relay_links(), streams=streams)
        self._entries = entries(plan, placement)

    def entry(self, buffer: PlannedBuffer) -> int:
        """The control rank of ``buffer``'s entry."""
        return self._placement.control_rank(self._entries[buffer.index])

    def send(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
             what: str) -> PendingTransfer:
        return self._send_to([self.entry(buffer)], view, stream=stream, done=done, what=what)

    def receive(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
                what: str) -> PendingTransfer:
        entry = self.entry(buffer)
        return self._receive_from(buffer.source if entry == self._me else entry, view,
                                  stream=stream, done=done, what=what)

    def forward(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream,
                what: str) -> list[PendingTransfer]:
        """From the entry to the source's other remote receivers (nothing elsewhere). On a GPU
        queue it right behind the receive on ``stream``; on the CPU, once the receive is done."""
        targets = self.targets(buffer) if self.entry(buffer) == self._me else []
        if not targets:
            return []
        names = ", ".join(self._placement.name_of(other) for other in targets)
        return [self._send_to(targets, view, stream=stream, done=None,
                              what=f"{what}, forwarded to {names}")]

    def targets(self, buffer: PlannedBuffer) -> Sequence[int]:
        """The control ranks ``buffer``'s entry forwards it to."""
        entry = self.entry(buffer)
        return [rank for r in self._placement.remote_receivers(buffer.source)
                if (rank := self._placement.control_rank(r)) != entry]


class DirectFanout(_LinkFanout):
    """Each buffer from its source to every remote inference rank it serves at once, each over
    its own link; nothing is forwarded. ``me`` is this rank's control rank, ``links`` its links
    by ``(from, to)`` control ranks (the relay's links include them)."""

    name = "direct"

    def __init__(self, *, placement: Placement, me: int, links: dict[Link, dist.ProcessGroup],
                 streams: DeviceStreams) -> None:
        super().__init__(placement=placement, me=me, links=links,
                         needed=placement.direct_links(), streams=streams)

    def send(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
             what: str) -> PendingTransfer:
        """To every remote receiver of the source at once: one transfer, done once all are."""
        receivers = [self._placement.control_rank(r)
                     for r in self._placement.remote_receivers(buffer.source)]
        return self._send_to(receivers, view, stream=stream, done=done, what=what)

    def receive(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream, done,
                what: str) -> PendingTransfer:
        return self._receive_from(buffer.source, view, stream=stream, done=done, what=what)

    def forward(self, buffer: PlannedBuffer, view: torch.Tensor, *, stream,
                what: str) -> list[PendingTransfer]:
        return []


AnyFanout = BroadcastFanout | RelayFanout | DirectFanout


def build_fanout(name: Fanout, *, plan: RefitPlan, placement: Placement, me: int,
                 data_groups: dict[int, dist.ProcessGroup],
                 links: dict[Link, dist.ProcessGroup], streams: DeviceStreams) -> AnyFanout:
    """The fan-out ``name`` (``refit.transport.fanout``) for control rank ``me``: over
    ``data_groups`` (broadcast; by source trainer rank) or ``links`` (relay, direct)."""
    if name == "relay":
        return RelayFanout(plan=plan, placement=placement, me=me, links=links, streams=streams)
    if name == "direct":
        return DirectFanout(placement=placement, me=me, links=links, streams=streams)
    return BroadcastFanout(data_groups=data_groups, streams=streams)


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
