"""Running micro-batches through Megatron's pipeline schedule over all model chunks.

One function drives Megatron's ``get_forward_backward_func`` for training and for forward-only
passes; with virtual pipeline parallelism it hands each chunk its own iterator over the same
micro-batches, as the interleaved schedule requires. Results exist on the last pipeline stage only;
:func:`broadcast_from_last_stage` shares them with the other stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mcore_refit.distributed import ModelParallel
from mcore_refit.model import ModelChunks

# One micro-batch: ``tokens``, ``labels``, ``position_ids`` ([batch, seq]) and whatever the loss
# reads (``loss_mask``, ``advantages``, ...), all on the model's device.
MicroBatch = dict[str, torch.Tensor]
# loss_func(per_token_output, micro_batch) -> what Megatron's schedule accepts from a loss
# function: (loss, metrics) or (loss, num_tokens, metrics).
LossFunc = Callable[[torch.Tensor, MicroBatch], tuple]


def forward_backward(model: ModelChunks, micro_batches: Sequence[MicroBatch], *,
                     loss_func: LossFunc, forward_only: bool, logits: bool = False) -> list[Any]:
    """Run ``micro_batches`` through every chunk; return the last stage's per-micro-batch metrics.

    Each micro-batch holds ``tokens``, ``position_ids`` and ``labels`` (``[batch, seq]``) and may
    hold ``attention_mask`` and anything ``loss_func`` needs. By default chunks are called with
    ``labels=``, so the last stage produces per-token cross entropy ``[batch, seq]`` (that is,
    −logprob of the label) in fp32. With ``logits=True`` chunks are called without labels and
    ``loss_func`` receives the last stage's logits ``[batch, seq, vocab / tp]`` (vocabulary-parallel
    under tensor parallelism; ``labels`` is then only passed through to ``loss_func``). All
    micro-batches must share one shape.

    Collective over the pipeline and tensor-parallel groups: call on every rank with the same
    micro-batches. Returns the metrics on the last pipeline stage and ``[]`` elsewhere. The
    schedule divides loss outputs in place, so ``loss_func`` must return detached clones as
    metrics.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    batch_size, seq_length = micro_batches[0]["tokens"].shape
    for index, micro_batch in enumerate(micro_batches):
        if micro_batch["tokens"].shape != (batch_size, seq_length):
            raise ValueError(
                f"micro-batch {index} has shape {tuple(micro_batch['tokens'].shape)}, "
                f"expected {(batch_size, seq_length)} like micro-batch 0"
            )

    def forward_step(data_iterator, chunk):
        micro_batch = next(data_iterator)
        output = chunk(
            input_ids=micro_batch["tokens"],
            position_ids=micro_batch["position_ids"],
            attention_mask=micro_batch.get("attention_mask"),
            labels=None if logits else micro_batch["labels"],
        )
        return output, lambda per_token: loss_func(per_token, micro_batch)

    iterators = [iter(micro_batches) for _ in model.chunks]
    schedule = get_forward_backward_func()
    return schedule(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model.chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=forward_only,
    )


def broadcast_from_last_stage(tensor: torch.Tensor | None, *, model_parallel: ModelParallel,
                              shape: Sequence[int], dtype: torch.dtype,
                              device: torch.device) -> torch.Tensor:
    """Return the last pipeline stage's ``tensor`` on every stage of this pipeline.

    Collective over the pipeline group. ``tensor`` is ignored (may be None) off the last stage.
    """
    group, src = model_parallel.pp_group, model_parallel.pp_last_rank
    if model_parallel.is_last_stage:
        assert tensor is not None and tuple(tensor.shape) == tuple(shape), (tensor, shape)
        buffer = tensor.to(device=device, dtype=dtype).contiguous()
    else:
        buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    if dist.get_world_size(group) > 1:
        dist.broadcast(buffer, src=src, group=group)
    return buffer
