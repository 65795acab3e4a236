"""Small checkpoints for tests of the code that checks and picks them."""

from __future__ import annotations

import json
import warnings

import torch


def write_checkpoint(directory):
    """A small torch_dist checkpoint (the format of Megatron's distributed checkpointing)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: "assuming the intent is to save
        dcp.save({"weight": torch.arange(64.0), "bias": torch.ones(16)},  # in a single process"
                 storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=True))
    (directory / "metadata.json").write_text(json.dumps({"chained_optim_avoid_prefix": True}))
    return directory
