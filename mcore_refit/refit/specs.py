"""Tensor specs: a tensor's name, shape, dtype and, for a piece, its region; their JSON form.

What the export yields and the plan lays out: a :class:`TensorSpec` per whole tensor, or per
piece of one (a rank that holds a tensor-parallel shard sends the piece it holds, placed by its
:class:`Region`). Pure; shared by every layer of the refit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Region:
    """Where a piece sits in its named tensor: ``[start, start + piece.shape[dim])`` along ``dim``,
    whose full size there is ``full`` (the other dimensions are whole)."""

    dim: int
    start: int
    full: int

    def narrow(self, tensor: torch.Tensor, length: int) -> torch.Tensor:
        """The piece's place in ``tensor`` (the whole named tensor)."""
        return tensor.narrow(self.dim, self.start, length)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one exported tensor, or of a piece of it (``region``: a rank
    that holds a tensor-parallel shard sends the piece it holds)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    region: Region | None = None

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The shape of the whole named tensor (a piece's region at its full size)."""
        if self.region is None:
            return self.shape
        shape = list(self.shape)
        shape[self.region.dim] = self.region.full
        return tuple(shape)

    @property
    def num_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def label(self) -> str:
        """The name, with the piece's place when it is a piece (for messages)."""
        if self.region is None:
            return self.name
        region = self.region
        return (f"{self.name}[dim {region.dim}: {region.start}:"
                f"{region.start + self.shape[region.dim]} of {region.full}]")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def spec_to_json(spec: TensorSpec) -> list:
    region = spec.region
    return [spec.name, list(spec.shape), dtype_name(spec.dtype),
            None if region is None else [region.dim, region.start, region.full]]


def spec_from_json(data: list) -> TensorSpec:
    name, shape, dtype, region = data
    return TensorSpec(name=name, shape=tuple(int(d) for d in shape), dtype=dtype_from_name(dtype),
                      region=None if region is None else Region(*(int(v) for v in region)))
