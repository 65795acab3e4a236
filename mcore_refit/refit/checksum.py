"""Exact integer checksums: per-buffer (cheap, every refit when enabled) and per-tensor digests
(the post-refit check that the engine's weights equal what the trainer exported).

Both work on raw bytes reinterpreted as integers and use wrap-around int64 arithmetic, which is
exact and independent of the summation order, so CPU and GPU, sender and receiver agree bit for
bit. Floating-point reductions are never used.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from mcore_refit.refit.specs import TensorSpec

DIGEST_WORDS = 3


def buffer_checksum(words: torch.Tensor, *, out: torch.Tensor) -> None:
    """Write the sum of ``words`` (int64, mod 2**64) into the 0-dim int64 ``out`` on the device.

    One device reduction, no host synchronisation. It detects any change of a single word and any
    stale or missing data; it does not detect two words swapping places (the per-tensor digest
    does).
    """
    assert words.dtype == torch.int64 and out.dtype == torch.int64 and out.dim() == 0
    torch.sum(words, dim=0, out=out)


class TensorDigester:
    """Digest of a tensor's bytes: three int64 words, sensitive to every word and its position.

    The bytes are read as words of the widest integer type dividing the byte count, in blocks of
    ``block_words``: ``d0`` is the plain sum, ``d1`` weighs each block's sum by its block number,
    ``d2`` weighs every word by its position within its block. Verification only: it allocates
    small temporaries.
    """

    def __init__(self, device: torch.device, *, block_words: int = 4096) -> None:
        self._device = torch.device(device)
        self._block_words = block_words
        self._weights = torch.arange(1, block_words + 1, dtype=torch.int64, device=self._device)

    def digest(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``[3]`` int64 digest of ``tensor``'s bytes, on this digester's device."""
        words = _as_words(tensor.detach().to(self._device))
        total = words.sum()
        num_blocks = words.numel() // self._block_words
        body = words[:num_blocks * self._block_words].view(num_blocks, self._block_words)
        tail = words[num_blocks * self._block_words:]
        by_block = (body.sum(dim=1) * self._ramp(num_blocks)).sum()
        by_block += tail.sum() * (num_blocks + 1)
        by_position = (body.sum(dim=0) * self._weights).sum()
        by_position += (tail * self._weights[:tail.numel()]).sum()
        return torch.stack([total, by_block, by_position])

    def table(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """``[num_tensors, 3]`` digests, one row per tensor, in order."""
        rows = [self.digest(t) for t in tensors]
        if not rows:
            return torch.zeros(0, DIGEST_WORDS, dtype=torch.int64, device=self._device)
        return torch.stack(rows)

    def _ramp(self, length: int) -> torch.Tensor:
        return torch.arange(1, length + 1, dtype=torch.int64, device=self._device)


class DigestRecorder:
    """Digests every tensor it is called with, in order (the sender's side of verification)."""

    def __init__(self, device: torch.device) -> None:
        self._digester = TensorDigester(device)
        self._device = torch.device(device)
        self.rows: list[torch.Tensor] = []
        self.seconds = 0.0

    def __call__(self, tensor) -> None:
        start = time.perf_counter()
        if hasattr(tensor, "materialize"):  # a Piecewise tensor
            tensor = tensor.materialize()
        self.rows.append(self._digester.digest(tensor))
        self.seconds += time.perf_counter() - start

    def table(self, num_tensors: int) -> torch.Tensor:
        """``[num_tensors, 3]``; all zeros unless every tensor was recorded (a failed refit)."""
        table = torch.zeros(num_tensors, DIGEST_WORDS, dtype=torch.int64, device=self._device)
        if len(self.rows) == num_tensors and num_tensors:
            table.copy_(torch.stack(self.rows))
        return table


def digest_table(rank_rows: Sequence[Sequence[Sequence[int]]], *, num_tensors: int) -> torch.Tensor:
    """The ``[num_tensors, 3]`` table of every rank's ``[plan position, d0, d1, d2]`` rows
    (:meth:`~mcore_refit.refit.producer.BufferProducer.digest_rows`, gathered), on the CPU."""
    table = torch.zeros(num_tensors, DIGEST_WORDS, dtype=torch.int64)
    for index, *digest in (row for rows in rank_rows for row in rows):
        table[index] = torch.tensor(digest, dtype=torch.int64)
    return table


def mismatched_names(names: Sequence[str], expected: torch.Tensor,
                     actual: torch.Tensor) -> list[str]:
    """Names whose digest rows differ between two ``[len(names), 3]`` tables."""
    assert expected.shape == actual.shape == (len(names), DIGEST_WORDS)
    differs = (expected.cpu() != actual.cpu()).any(dim=1).tolist()
    return [name for name, bad in zip(names, differs, strict=True) if bad]


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 words; the word width depends only on the byte count."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0:
            break
    else:
        dtype = torch.uint8
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # fresh allocations are aligned; a view at an odd offset may not be
    words = raw.view(dtype)
    return words if dtype == torch.int64 else words.to(torch.int64)


def verify_engine_weights(engine: object, specs: Sequence[TensorSpec], expected: torch.Tensor, *,
                          max_names: int = 10) -> str | None:
    """Compare the engine's loaded weights with the sender's digest table.

    ``engine`` must offer ``get_weight(name)``; an engine with ``check_loaded()`` (``None`` or
    a message) is also asked to check the weights it computes with. ``expected`` is the
    ``[len(specs), 3]`` table of the trainer's digests of every planned tensor (a piece is
    compared with its region of the engine's weight). Returns ``None`` when every tensor
    matches, else a message naming the mismatches.
    """
    get_weight = getattr(engine, "get_weight", None)
    if get_weight is None:
        return (f"cannot verify: the engine ({type(engine).__name__}) has no get_weight(name) to "
                "read its weights back")
    digester = TensorDigester(expected.device)

    def loaded(spec: TensorSpec) -> torch.Tensor:
        weight = get_weight(spec.name)
        if spec.region is None:
            return weight
        return spec.region.narrow(weight, spec.shape[spec.region.dim])

    actual = digester.table(loaded(spec) for spec in specs)
    labels = [spec.label for spec in specs]
    bad = mismatched_names(labels, expected, actual)
    if not bad:
        # An engine that transforms what it received (vLLM: fused, sharded, repacked weights)
        # also checks its own weights against what its loader makes of the received tensors.
        check_loaded = getattr(engine, "check_loaded", None)
        return check_loaded() if check_loaded is not None else None
    shown = ", ".join(repr(n) for n in bad[:max_names])
    more = f" and {len(bad) - max_names} more" if len(bad) > max_names else ""
    return (f"post-refit check failed: {len(bad)} of {len(specs)} engine weights differ "
            f"from the trainer's export: {shown}{more}")
