"""The ranks torchrun gives a process, read from the environment mapping a recipe passes in.

    ranks = TorchrunRanks.from_environment(os.environ, command="torchrun ... recipes/grpo.py ...")

Library code never reads the environment itself; a recipe started without torchrun gets an
error that says how to launch it, not a ``KeyError: 'RANK'``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


class LaunchError(ValueError):
    """The process was not started the way the recipe needs."""


@dataclass(frozen=True, kw_only=True)
class TorchrunRanks:
    """This process's place in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    # This node's ranks (a multi-node launch picks each node's devices by them).
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], *, command: str) -> TorchrunRanks:
        """Read torchrun's variables; ``command`` (how to launch) goes into the error."""
        missing = [name for name in _VARIABLES if name not in environ]
        if missing:
            raise LaunchError(f"{', '.join(missing)} not set: this recipe runs under torchrun, "
                              f"e.g. `{command}`")
        try:
            ranks = cls(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                        local_rank=int(environ["LOCAL_RANK"]),
                        local_world_size=int(environ["LOCAL_WORLD_SIZE"]),
                        master_addr=environ["MASTER_ADDR"],
                        master_port=int(environ["MASTER_PORT"]))
        except ValueError as error:
            raise LaunchError(f"torchrun's environment is malformed: {error}") from None
        if not 0 <= ranks.rank < ranks.world_size:
            raise LaunchError(f"RANK={ranks.rank} is outside WORLD_SIZE={ranks.world_size}")
        return ranks
