"""A host copy of a model's weights that can stand in for the live weights for a while."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class ReferenceWeights:
    """Host snapshot of every parameter of every chunk, in ``parameters`` order.

    :meth:`swapped_in` points each parameter's ``.data`` at a device copy of the snapshot and puts
    the original tensors back on exit: the live weights are never written, the Parameter objects
    stay the same and the optimizer is untouched.
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        self._parameters = list(parameters)
        self._host = [_host_copy(param.detach()) for param in self._parameters]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the reference weights (device memory: one copy)."""
        live = [param.data for param in self._parameters]
        try:
            for param, host in zip(self._parameters, self._host, strict=True):
                param.data = host.to(param.device, non_blocking=True)
            yield
        finally:
            for param, data in zip(self._parameters, live, strict=True):
                param.data = data


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = tensor.to("cpu", copy=True)
    # Pinned memory makes the device copies in swapped_in asynchronous.
    return host.pin_memory() if tensor.is_cuda else host
