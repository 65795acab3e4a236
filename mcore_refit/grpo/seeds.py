"""Sampling seeds derived from the run's seed: a step's randomness depends on nothing before it."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part (the run's seed, the step, the engine's shard).

    Sampling with a seed derived from the step makes a step's rollouts independent of what the
    engines sampled before it: a resumed run samples what an uninterrupted one would have.
    """
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
