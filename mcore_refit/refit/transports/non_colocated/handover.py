"""The IPC hand-over of a non-colocated job: a source trainer rank's slots, read in place by the
inference ranks on its own device (NCCL refuses two ranks of one device in a communicator).

The source shares its slots' handles once (:meth:`HandoverSource.share`; on CPU its slots are
shared-memory files it owns in the private directory); per buffer it tells each such receiver
the buffer is in its slot and later takes the receiver's ACK, which carries whether the load
worked. Every message goes over the job's control plane (host waits, gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_refit.control import ControlGroup, PendingWords
from mcore_refit.refit.buffers import BufferSlots, BufferStatus
from mcore_refit.refit.config import TransportOptions
from mcore_refit.refit.errors import RefitError
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan
from mcore_refit.refit.transports.ipc_files import (
    OwnerRecord,
    claim_owner,
    create_shared_cpu_slot,
    describe_slot,
    open_slot,
    private_runtime_dir,
    sweep_stale_files,
)
from mcore_refit.refit.transports.non_colocated.placement import Placement
from mcore_refit.refit.transports.wire import SlotHandle, WireError, from_fields, to_fields

# Tags of the control plane's point-to-point messages between a source and an IPC receiver:
# the slots' handles (JSON, once); per buffer, [refit, buffer, status] and [buffer, ok] words.
_TAG_SLOTS, _TAG_READY, _TAG_ACK = 1, 2, 3


@dataclass
class HandedBuffer:
    """A buffer announced to one receiver: the announcement and the ACK, both in flight."""

    buffer: PlannedBuffer
    receiver: int
    ready: PendingWords
    ack: PendingWords


class HandoverSource:
    """A source trainer rank's end: its slots, shared with ``receivers`` (inference ranks on
    its device)."""

    def __init__(self, *, control: ControlGroup, placement: Placement, rank: int,
                 receivers: list[int], options: TransportOptions,
                 cpu_device_id: str | None) -> None:
        self._control = control
        self._placement = placement
        self._rank = rank
        self.receivers = receivers
        self._options = options
        self._cpu_device_id = cpu_device_id
        self._owner: OwnerRecord | None = None
        self._slot_files: list[Path] = []

    def allocate(self, plan: RefitPlan, device: torch.device) -> BufferSlots:
        """Slots the receivers can map: device memory (CUDA IPC), or on CPU shared-memory files
        in the private directory, owned by this process while it lives."""
        if device.type == "cuda":
            return BufferSlots.allocate(plan, device)
        directory = private_runtime_dir(self._options.ipc_dir)
        key = f"{self._cpu_device_id}-trainer{self._rank}"
        sweep_stale_files(directory)
        self._owner = claim_owner(directory, key)  # the start-up sweep keeps them while we live
        slots = []
        for index in range(plan.num_held_slots):
            path = directory / f"{key}.slot{index}"
            slots.append(create_shared_cpu_slot(path, plan.slot_capacity(index)))
            self._slot_files.append(path)
        return BufferSlots(plan=plan, slots=slots)

    def share(self, slots: BufferSlots) -> None:
        """Send every receiver the handles of ``slots`` (once)."""
        handles, blobs = [], []
        for index, slot in enumerate(slots.slots):
            cpu_file = self._slot_files[index] if self._slot_files else None
            handle, slot_blobs = describe_slot(slot, cpu_file=cpu_file, first_blob=len(blobs))
            handles.append(to_fields(handle))
            blobs.extend(blob.hex() for blob in slot_blobs)
        for receiver in self.receivers:
            self._control.send_json({"slots": handles, "blobs": blobs},
                                    dst=self._placement.control_rank(receiver), tag=_TAG_SLOTS,
                                    what=f"trainer rank {self._rank}'s slot handles",
                                    timeout_s=self._options.start_timeout_s)

    def hand_over(self, buffer: PlannedBuffer, *, refit_index: int,
                  status: BufferStatus) -> list[HandedBuffer]:
        """Tell every receiver ``buffer`` is in its slot; each ACK's receive is posted first."""
        handed = []
        for receiver in self.receivers:
            peer = self._placement.control_rank(receiver)
            ack = self._control.recv_words(
                2, src=peer, tag=_TAG_ACK,
                what=f"inference rank {receiver}'s ACK of buffer {buffer.index} of refit "
                     f"{refit_index}")
            ready = self._control.send_words(
                [refit_index, buffer.index, int(status)], dst=peer, tag=_TAG_READY,
                what=f"handing buffer {buffer.index} of refit {refit_index} to inference rank "
                     f"{receiver}")
            handed.append(HandedBuffer(buffer=buffer, receiver=receiver, ready=ready, ack=ack))
        return handed

    def acknowledged(self, handed: list[HandedBuffer]) -> RefitError | None:
        """Wait for the receivers' ACKs of a buffer; the first failure they report."""
        failure = None
        for item in handed:
            item.ready.wait(timeout_s=self._options.timeout_s)
            index, ok = item.ack.wait(timeout_s=self._options.timeout_s)
            if index != item.buffer.index:
                failure = failure or RefitError(
                    f"inference rank {item.receiver} acknowledged buffer {index}, expected "
                    f"{item.buffer.index}")
            elif not ok:
                failure = failure or RefitError(
                    f"inference rank {item.receiver} could not load buffer {item.buffer.index} "
                    "(its own error follows from it)")
        return failure

    def close(self) -> None:
        """Remove the slot files and drop the ownership record (idempotent)."""
        for path in self._slot_files:
            path.unlink(missing_ok=True)
        self._slot_files.clear()
        if self._owner is not None:
            self._owner.release()
            self._owner = None


class HandoverTarget:
    """An inference rank's end: the slots of the sources on its device, mapped once."""

    def __init__(self, *, control: ControlGroup, device: torch.device,
                 options: TransportOptions) -> None:
        self._control = control
        self._device = device
        self._options = options

    def map(self, plan: RefitPlan, *, source: int) -> BufferSlots:
        """Receive ``source``'s slot handles and map its slots."""
        data = self._control.recv_json(src=source, tag=_TAG_SLOTS,
                                       timeout_s=self._options.start_timeout_s,
                                       what=f"trainer rank {source}'s slot handles")
        handles = [_slot_handle(handle) for handle in data["slots"]]
        blobs = [bytes.fromhex(blob) for blob in data["blobs"]]
        directory = private_runtime_dir(self._options.ipc_dir)
        slots = [open_slot(handle, blobs, device=self._device, directory=directory)
                 for handle in handles]
        return BufferSlots(plan=plan, slots=slots)

    def wait_ready(self, buffer: PlannedBuffer, *, refit_index: int) -> RefitError | None:
        """Wait for the source's word that ``buffer`` is in its slot; a mismatch, if any."""
        source = buffer.source
        ready_index, index, _status = self._control.recv_words(
            3, src=source, tag=_TAG_READY,
            what=f"trainer rank {source}'s buffer {buffer.index} of refit {refit_index}").wait(
            timeout_s=self._options.timeout_s)
        if (ready_index, index) != (refit_index, buffer.index):
            return RefitError(f"trainer rank {source} handed over buffer {index} of refit "
                              f"{ready_index}, expected buffer {buffer.index} of refit "
                              f"{refit_index}")
        return None

    def acknowledge(self, buffer: PlannedBuffer, *, ok: bool) -> None:
        """Tell the source it may refill ``buffer``'s slot, and whether the load worked."""
        self._control.send_words(
            [buffer.index, int(ok)], dst=buffer.source, tag=_TAG_ACK,
            what=f"the ACK of buffer {buffer.index} to trainer rank {buffer.source}").wait(
            timeout_s=self._options.timeout_s)


def _slot_handle(data) -> SlotHandle:
    try:
        return from_fields(SlotHandle, data)
    except WireError as error:
        raise RefitError(f"malformed SlotHandle on the control plane: {error}") from None
