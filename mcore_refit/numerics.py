"""Non-finite numbers: the error a training step stops with when one of its inputs or results is
NaN or infinite, before it changes anything (weights, optimizer, checkpoints, the engines)."""

from __future__ import annotations

import math

import torch


class NonFiniteError(FloatingPointError):
    """A number a step depends on (a reward, an advantage, the loss, the gradient norm) is NaN
    or infinite; the message names the quantity, and where it is known the step and the sample.
    The step stopped before the optimizer update."""


def first_non_finite(values: torch.Tensor) -> int | None:
    """The flat index of the first NaN or infinite entry of ``values``, or None (one check over
    the whole tensor: one device sync, not one per entry)."""
    finite = torch.isfinite(values.detach().flatten())
    if bool(finite.all()):
        return None
    return int((~finite).nonzero()[0].item())


def check_finite(name: str, value: float) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` unless ``value`` is a finite number."""
    if not math.isfinite(value):
        raise NonFiniteError(f"the {name} is {value}")
