"""Tensor helpers shared by the tests."""

import torch


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat: two tensors are bitwise equal iff their ``bits`` are equal."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
