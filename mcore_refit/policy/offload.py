"""Moving a model's device memory to the host and back without replacing any tensor object.

Offloading works on *storages*: each storage's bytes are copied to a host buffer and the storage
is resized to zero, which frees the device memory while every tensor viewing it (parameters,
Megatron's flat DDP buffers and their bucket views, ``main_grad``, optimizer state) stays the same
Python object. Onloading resizes the storages back and copies the bytes in. Anything holding
references to parameters (the bridge's cached conversion tasks, the optimizer) keeps working and
sees the current values. This is the mechanism Megatron's own ``offload_grad_buffers`` uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class _StorageCopy:
    storage: torch.UntypedStorage
    num_bytes: int
    # None: the contents are not kept (gradient buffers); onload zeroes the storage instead.
    host: torch.Tensor | None


class HostOffloader:
    """Holds the host copies while offloaded. One offload at a time; ``onload`` undoes it.

    Host buffers (pinned when the device is a GPU) are allocated on the first offload and reused
    by later ones while the storage sizes stay the same; ``close`` releases them.
    """

    def __init__(self) -> None:
        self._copies: list[_StorageCopy] | None = None
        self._host_buffers: list[torch.Tensor] = []

    @property
    def offloaded(self) -> bool:
        return self._copies is not None

    @property
    def freed_bytes(self) -> int:
        """Device bytes released by the current offload (0 when not offloaded)."""
        return sum(c.num_bytes for c in self._copies or ())

    def offload(self, *, keep: Iterable[torch.Tensor], discard: Iterable[torch.Tensor]) -> None:
        """Copy the storages of ``keep`` to the host, then free them and those of ``discard``.

        A storage reached from both lists is kept. ``discard`` is for contents nobody needs back
        (gradient buffers are zeroed before every step); they come back as zeros.
        """
        if self._copies is not None:
            raise RuntimeError("already offloaded; call onload() first")
        kept = _unique_storages(keep)
        dropped = {ptr: s for ptr, s in _unique_storages(discard).items() if ptr not in kept}
        copies = []
        for position, storage in enumerate(kept.values()):
            device_bytes = _byte_view(storage)
            host = self._host_buffer(position, storage.nbytes(), pin=device_bytes.is_cuda)
            host.copy_(device_bytes, non_blocking=True)
            copies.append(_StorageCopy(storage=storage, num_bytes=storage.nbytes(), host=host))
        copies += [_StorageCopy(storage=s, num_bytes=s.nbytes(), host=None)
                   for s in dropped.values()]
        _synchronize(copies)
        for copy in copies:
            copy.storage.resize_(0)
        self._copies = copies

    def onload(self) -> None:
        """Reallocate every offloaded storage and restore its bytes (zeros for discarded ones)."""
        if self._copies is None:
            raise RuntimeError("not offloaded; nothing to onload")
        for copy in self._copies:
            copy.storage.resize_(copy.num_bytes)
            device_bytes = _byte_view(copy.storage)
            if copy.host is None:
                device_bytes.zero_()
            else:
                device_bytes.copy_(copy.host, non_blocking=True)
        _synchronize(self._copies)
        self._copies = None

    def close(self) -> None:
        """Release the host buffers (onload first if offloaded)."""
        if self._copies is not None:
            raise RuntimeError("close() while offloaded would lose the weights; onload() first")
        self._host_buffers = []

    def _host_buffer(self, position: int, num_bytes: int, *, pin: bool) -> torch.Tensor:
        if position < len(self._host_buffers):
            if self._host_buffers[position].numel() == num_bytes:
                return self._host_buffers[position]
            self._host_buffers = self._host_buffers[:position]
        buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
        self._host_buffers.append(buffer)
        return buffer


def _unique_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), storage)
    return storages


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _synchronize(copies: list[_StorageCopy]) -> None:
    if any(c.storage.device.type == "cuda" for c in copies):
        torch.cuda.synchronize()
