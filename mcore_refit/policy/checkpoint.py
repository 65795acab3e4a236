"""Saving and loading a policy's training state with Megatron's distributed checkpointing.

A checkpoint holds every model chunk, the optimizer (master weights and Adam moments), the
learning-rate scheduler and the policy's step count, in Megatron's ``torch_dist`` format.

Entry scripts that save must guard their work with ``if __name__ == "__main__":``: the
``torch_dist`` writer starts a spawn-mode process pool, which re-imports the main module.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from mcore_refit.compat import in_process_write_results
from mcore_refit.model import ModelChunks
from mcore_refit.policy.optim import inner_optimizers

# Sharding choices, stored in the checkpoint and read back on load so both sides agree.
_BASE_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def save_checkpoint(path: str | Path, *, model: ModelChunks, optimizer, scheduler,
                    step: int, use_distributed_optimizer: bool) -> None:
    """Write ``model``, ``optimizer``, ``scheduler`` and ``step`` to the directory ``path``.

    Collective: call on every rank, with a ``path`` all ranks can reach (a shared filesystem).
    """
    metadata = dict(_BASE_METADATA)
    if use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    from megatron.core import dist_checkpointing

    state = _sharded_state(model, optimizer, metadata=metadata, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["step"] = step
    # Synchronous: the writer's threads report to a queue of this process, not a manager process
    # (which would outlive a killed trainer).
    with in_process_write_results():
        dist_checkpointing.save(state, str(path), content_metadata=metadata)
    dist.barrier()


def load_checkpoint(path: str | Path, *, model: ModelChunks, optimizer, scheduler) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` into the live objects; return its step.

    The same layout (tensor, pipeline, virtual pipeline) is expected. Parameters are updated in
    place, so references to them (the bridge's conversion tasks) stay valid. Collective: call on
    every rank.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise ValueError(f"{str(path)!r} is not a distributed checkpoint (no metadata.json)")
    metadata = dist_checkpointing.load_content_metadata(str(path))
    if metadata is None or "chained_optim_avoid_prefix" not in metadata:
        raise ValueError(f"{str(path)!r} was not written by mcore_refit's save_checkpoint")
    _materialize_distributed_optimizer_state(optimizer)
    state = _sharded_state(model, optimizer, metadata=metadata, is_loading=True)
    state["scheduler"] = scheduler.state_dict()
    state["step"] = 0
    loaded = dist_checkpointing.load(state, str(path))

    for key, chunk in zip(_chunk_keys(len(model)), model.unwrapped(), strict=True):
        chunk.load_state_dict(loaded[key], strict=True)
    # distrib_optimizer.py:2061 load_parameter_state_from_dp_reshardable (megatron-core 0.19.2)
    # lacks the @torch.no_grad() of its neighbours, and its copy_ at :1225 into fp32 main params
    # (views of the model's parameters) then raises "a view of a leaf Variable that requires grad
    # is being used in an in-place operation" (seen at fp32 with expert parallelism).
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_distributed_optimizer_steps(optimizer, loaded["optimizer"])
    # OptimizerParamScheduler.load_state_dict advances from the current count by the saved one.
    scheduler.num_steps = 0
    scheduler.load_state_dict(loaded["scheduler"])
    return int(loaded["step"])


def _chunk_keys(num_chunks: int) -> list[str]:
    # Megatron's naming: "model" for one chunk, "model0", "model1", ... with virtual pipelining.
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def _sharded_state(model: ModelChunks, optimizer, *, metadata: dict, is_loading: bool) -> dict:
    # Sharded state dicts come from the unwrapped GPTModels: the DDP / Float16Module wrappers have
    # none of their own and would prefix every key with "module.".
    state = {key: chunk.sharded_state_dict(metadata=metadata)
             for key, chunk in zip(_chunk_keys(len(model)), model.unwrapped(), strict=True)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                      metadata=metadata)
    return state


def _materialize_distributed_optimizer_state(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer its Adam state before building the load dict.

    Without TE or apex its ``state_dict()`` reads each parameter's ``step`` from the torch
    optimizer's state (distrib_optimizer.py:837), which is empty until the first step. The dummy
    step (zero gradients) touches only values the load overwrites.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in inner_optimizers(optimizer):
        if isinstance(inner, DistributedOptimizer) and len(inner.optimizer.state) == 0:
            inner._init_optimizer_states_with_dummy_values()


def _restore_distributed_optimizer_steps(optimizer, loaded_state) -> None:
    """Put the checkpoint's Adam step back into every parameter's state.

    With the dp_reshardable format, DistributedOptimizer.load_state_dict sets ``step`` from the
    loaded param groups (distrib_optimizer.py:1026) into one tensor shared by all parameters, and
    loading the parameter state then copies this process's *current* step into that tensor
    (``step`` is a LocalNonpersistentObject, distrib_optimizer.py:1953). Left alone, the resumed
    run uses a stale bias correction and silently diverges.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = inner_optimizers(optimizer)
    per_inner = ([loaded_state] if len(inners) == 1
                 else [loaded_state[key] for key in sorted(loaded_state)])
    for inner, state in zip(inners, per_inner, strict=True):
        if not isinstance(inner, DistributedOptimizer):
            continue
        steps = {group["step"] for group in state["optimizer"]["param_groups"] if "step" in group}
        if not steps:
            continue
        assert len(steps) == 1, f"parameter groups disagree on the optimizer step: {steps}"
        (step,) = steps
        for param_state in inner.optimizer.state.values():
            if "step" in param_state:
                # A tensor per parameter, as torch's Adam keeps it (not one shared tensor).
                param_state["step"] = torch.full_like(param_state["step"], float(step))
