"""The Megatron policy worker: one object owning a chunk list, its optimizer and their state.

Every method works on the whole list of model chunks (one per virtual pipeline stage). Unless its
docstring says otherwise it is a collective over all training ranks: call it on every rank, in the
same order, with the same arguments (the same batch everywhere; each data-parallel rank picks its
own share).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_refit.config import ModelConfig
from mcore_refit.control import ControlGroup
from mcore_refit.distributed import ModelParallel
from mcore_refit.losses import CrossEntropyLoss, LossFunction, LossOutput, check_loss_inputs
from mcore_refit.model import ModelChunks, build_model
from mcore_refit.numerics import NonFiniteError, check_finite
from mcore_refit.pipeline import forward_backward
from mcore_refit.policy import checkpoint
from mcore_refit.policy.batch import MicroBatch, SequenceBatch, build_micro_batches, scatter_rows
from mcore_refit.policy.config import PolicyConfig
from mcore_refit.policy.offload import HostOffloader
from mcore_refit.policy.optim import (
    build_optimizer,
    build_scheduler,
    current_lr,
    optimizer_state_tensors,
    step_if_finite,
)
from mcore_refit.policy.packing import PackingPlan, pack_for_layout
from mcore_refit.policy.reference import ReferenceWeights
from mcore_refit.refit import ModelExport


@dataclass(frozen=True, kw_only=True)
class TrainMetrics:
    """Outcome of one train step; identical on every rank.

    ``loss`` and ``metrics`` are means over the ``num_tokens`` loss tokens of the global batch;
    ``lr`` is the learning rate this step used; ``grad_norm`` the global norm before clipping.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    num_sequences: int
    num_micro_batches: int
    update_successful: bool
    time_s: float
    metrics: dict[str, float] = field(default_factory=dict)


def build_policy(model_config: ModelConfig, model_parallel: ModelParallel, config: PolicyConfig,
                 *, device: torch.device) -> Policy:
    """Build the DDP-wrapped chunks, optimizer and scheduler for ``config`` in the layout
    :func:`mcore_refit.distributed.init_model_parallel` returned. Call on every rank."""
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
    )
    # calculate_per_token_loss is read when DDP wraps the chunks (it decides the gradient
    # pre-scaling), so it must be set on the provider, not on the built model's config.
    model = build_model(model_config, model_parallel, device=device, wrap_with_ddp=True,
                        ddp_config=ddp_config,
                        provider_overrides={"calculate_per_token_loss": True})
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_scheduler(optimizer, config.optimizer)
    return Policy(model=model, optimizer=optimizer, scheduler=scheduler, config=config,
                  device=device)


class Policy:
    """Train steps, logprobs, reference logprobs, offload and checkpoints over all chunks.

    Construct through :func:`build_policy`. With ``config.reference_model`` the weights at
    construction are kept on the host as the reference model (a later :meth:`load_checkpoint`
    does not change them; :meth:`capture_reference` does).
    """

    def __init__(self, *, model: ModelChunks, optimizer, scheduler, config: PolicyConfig,
                 device: torch.device) -> None:
        from megatron.core.distributed import finalize_model_grads

        transformer_config = model.transformer_config
        if not transformer_config.calculate_per_token_loss:
            raise ValueError("the policy needs chunks built with calculate_per_token_loss=True "
                             "(use build_policy)")
        # Without these, tied embeddings at PP>1 get wrong gradients (their all-reduce between
        # first and last stage happens in finalize_model_grads) and the per-token normalisation
        # never happens.
        transformer_config.finalize_model_grads_func = finalize_model_grads
        transformer_config.grad_scale_func = optimizer.scale_loss
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config
        self.device = device
        self._ranks = model.model_parallel
        self._check_vocab()
        self._step = 0
        self._offloader = HostOffloader()
        self._reference: ReferenceWeights | None = None
        if config.reference_model:
            self.capture_reference()

    # ---------------------------------------------------------------------------------------
    # State
    # ---------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer updates applied so far (restored by :meth:`load_checkpoint`)."""
        return self._step

    @property
    def offloaded(self) -> bool:
        return self._offloader.offloaded

    def capture_reference(self) -> None:
        """Take the current weights as the reference model (host copy; replaces any earlier one)."""
        self._require_onloaded("capture_reference")
        self._reference = ReferenceWeights(list(self.model.parameters()))

    def weight_source(self, *, control: ControlGroup, prefer: Collection[int] = ()) -> ModelExport:
        """The refit source over this policy's weights: each trainer rank exports what it holds
        (:class:`~mcore_refit.refit.export.ModelExport`); a refit while the weights are offloaded
        raises. ``control``: a gloo group over the trainer ranks. Collective over them."""
        return ModelExport(self.model, control=control, device=self.device, prefer=prefer,
                           guard=lambda: self._require_onloaded("a refit"))

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` pairs of the current weights; see ``ModelChunks``.

        Collective: every rank must iterate it to the end, in lockstep.
        """
        self._require_onloaded("export_hf_weights")
        return self.model.export_hf_weights()

    def close(self) -> None:
        """Release host buffers (offload copies, reference weights). The model stays usable."""
        if self.offloaded:
            self.onload()
        self._offloader.close()
        self._reference = None

    # ---------------------------------------------------------------------------------------
    # Training
    # ---------------------------------------------------------------------------------------

    def train_step(self, batch: SequenceBatch, *, loss_fn: LossFunction | None = None
                   ) -> TrainMetrics:
        """One optimizer step on ``batch`` with ``loss_fn`` (default: cross entropy).

        The batch is packed into micro-batches (see :meth:`packing_plan`), run through the
        pipeline schedule with the loss normalised by the global token count, then gradients are
        clipped and the optimizer and scheduler step. A NaN or infinite loss or gradient norm
        raises :class:`~mcore_refit.numerics.NonFiniteError` on every rank before the update.
        Collective: call on every rank with the same batch.
        """
        self._require_onloaded("train_step")
        loss_fn = loss_fn if loss_fn is not None else CrossEntropyLoss()
        check_loss_inputs(loss_fn, batch_fields=batch.fields.keys())
        start = time.perf_counter()
        plan = self.packing_plan(batch)
        micro_batches = self._micro_batches(batch, plan)
        self.model.train()
        for chunk in self.model.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = current_lr(self.optimizer)

        outputs = forward_backward(self.model, micro_batches, loss_func=self._loss(loss_fn),
                                   forward_only=False, logits=True)
        totals = self._global_sums(outputs, ("loss", "num_tokens", *loss_fn.metric_names))
        num_tokens = int(totals["num_tokens"])
        per_token = max(num_tokens, 1)
        loss = totals["loss"] / per_token
        try:
            check_finite("loss", loss)
            update_successful, grad_norm = step_if_finite(self.optimizer)
        except NonFiniteError as error:
            raise NonFiniteError(f"{error} in optimizer step {self._step + 1}; the update was "
                                 "not applied") from None
        if update_successful:
            self.scheduler.step(increment=1)
            self._step += 1
        return TrainMetrics(
            step=self._step,
            loss=loss,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            num_tokens=num_tokens,
            num_sequences=batch.num_sequences,
            num_micro_batches=len(micro_batches),
            update_successful=bool(update_successful),
            time_s=time.perf_counter() - start,
            metrics={name: totals[name] / per_token for name in loss_fn.metric_names},
        )

    def packing_plan(self, batch: SequenceBatch) -> PackingPlan:
        """How ``batch`` is split into micro-batches and dealt to data-parallel ranks."""
        packing = self.config.packing
        return pack_for_layout(
            batch.length_list(),
            max_tokens_per_bin=packing.max_tokens_per_micro_batch,
            dp_size=self._ranks.dp_size,
            pp_size=self._ranks.pp_size,
            min_bin_count=packing.min_bin_count,
            bin_count_multiple=packing.bin_count_multiple,
        )

    # ---------------------------------------------------------------------------------------
    # Log-probabilities
    # ---------------------------------------------------------------------------------------

    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """Per-token log-probabilities ``[num_sequences, max_len]`` (fp32) on every rank.

        ``out[i, t]`` is log p(tokens[i, t] | tokens[i, :t]) at ``config.temperature``; it is 0
        at ``t = 0`` and at padding. Forward only; the weights are untouched. Collective: call on
        every rank with the same batch.
        """
        self._require_onloaded("logprobs")
        plan = self.packing_plan(batch)
        micro_batches = self._micro_batches(batch, plan)
        self.model.eval()

        def keep_logprobs(logprobs: torch.Tensor, micro_batch: MicroBatch) -> LossOutput:
            return LossOutput(loss_sum=logprobs.new_zeros(()),
                              num_tokens=torch.zeros((), dtype=torch.int, device=logprobs.device),
                              metrics={"logprobs": logprobs.detach().clone()})

        with torch.no_grad():
            outputs = forward_backward(self.model, micro_batches,
                                       loss_func=self._loss(keep_logprobs), forward_only=True,
                                       logits=True)
        result = torch.zeros((batch.num_sequences, batch.max_len), dtype=torch.float32,
                             device=self.device)
        if self._ranks.is_last_stage:
            scatter_rows([out["logprobs"] for out in outputs],
                         plan.bins_for_rank(self._ranks.dp_rank), out=result)
        # Each data-parallel rank filled its own rows and left zeros elsewhere, so the sum is
        # exact; then the last stage's result goes to the other stages.
        dist.all_reduce(result, group=self._ranks.dp_group)
        dist.broadcast(result, src=self._ranks.pp_last_rank, group=self._ranks.pp_group)
        return result

    def reference_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """:meth:`logprobs` under the reference weights; the live weights are left as they were."""
        self._require_onloaded("reference_logprobs")
        if self._reference is None:
            raise RuntimeError("no reference model: set reference_model: true or call "
                               "capture_reference()")
        with self._reference.swapped_in():
            return self.logprobs(batch)

    # ---------------------------------------------------------------------------------------
    # Offload and checkpoints
    # ---------------------------------------------------------------------------------------

    def offload(self) -> int:
        """Move parameters and optimizer state to host memory and free the gradient buffers.

        Parameter objects stay the same (their storage is emptied and later refilled), so cached
        export tasks remain valid. Returns the device bytes released. Local to this rank.
        """
        keep = [param.data for param in self.model.parameters()]
        discard = []
        for chunk in self.model.chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                if buffer.param_data is not None:
                    keep.append(buffer.param_data)
                discard.append(buffer.grad_data)
        keep.extend(optimizer_state_tensors(self.optimizer))
        self._offloader.offload(keep=keep, discard=discard)
        return self._offloader.freed_bytes

    def onload(self) -> None:
        """Bring back what :meth:`offload` moved; gradient buffers come back zeroed."""
        self._offloader.onload()

    def save_checkpoint(self, path: str | Path) -> None:
        """Save chunks, optimizer, scheduler and step under ``path``. Collective."""
        self._require_onloaded("save_checkpoint")
        checkpoint.save_checkpoint(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            step=self._step,
            use_distributed_optimizer=self.config.optimizer.use_distributed_optimizer,
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint of the same layout; training continues bit-identically. Collective.

        The reference weights are not part of the checkpoint and stay as they were.
        """
        self._require_onloaded("load_checkpoint")
        self._step = checkpoint.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                                scheduler=self.scheduler)

    # ---------------------------------------------------------------------------------------
    # Internals
    # ---------------------------------------------------------------------------------------

    def _micro_batches(self, batch: SequenceBatch, plan: PackingPlan) -> list[MicroBatch]:
        pad_to_multiple = self.config.packing.pad_to_multiple
        if self.model.parallel.sequence_parallel:
            pad_to_multiple = math.lcm(pad_to_multiple, self._ranks.tp_size)
        # Expert-parallel ranks exchange tokens inside every MoE layer: one shape on all of them.
        shape_bins = plan.bins if self._ranks.ep_size > 1 else None
        return build_micro_batches(batch, plan.bins_for_rank(self._ranks.dp_rank),
                                   pad_to_multiple=pad_to_multiple, device=self.device,
                                   shape_bins=shape_bins)

    def _loss(self, loss_fn: LossFunction):
        """Megatron's loss_func: logits → token-aligned logprobs → ``loss_fn``."""
        temperature = self.config.temperature

        def loss_func(logits: torch.Tensor, micro_batch: MicroBatch):
            logprobs = token_logprobs(logits, micro_batch, temperature=temperature)
            output = loss_fn(logprobs, micro_batch)
            if set(output.metrics) != set(getattr(loss_fn, "metric_names", output.metrics)):
                # Only the last stage sees this: a broken loss function, not bad input.
                raise ValueError(f"loss returned metrics {sorted(output.metrics)}, declared "
                                 f"metric_names {loss_fn.metric_names}")
            metrics = {name: value.detach().clone() for name, value in output.metrics.items()}
            metrics["loss"] = output.loss_sum.detach().clone()
            metrics["num_tokens"] = output.num_tokens.detach().clone()
            return output.loss_sum, output.num_tokens, metrics

        return loss_func

    def _global_sums(self, outputs: list[dict], names: tuple[str, ...]) -> dict[str, float]:
        """Sum ``names`` over micro-batches and data-parallel ranks; the result on every rank."""
        totals = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        if self._ranks.is_last_stage:
            for output in outputs:
                totals += torch.stack([output[name].to(totals) for name in names])
        dist.all_reduce(totals, group=self._ranks.dp_group)
        dist.broadcast(totals, src=self._ranks.pp_last_rank, group=self._ranks.pp_group)
        return dict(zip(names, totals.tolist(), strict=True))

    def _check_vocab(self) -> None:
        # Log-softmax over a padded vocabulary would give the padding entries probability mass
        # that the inference engine's (unpadded) distribution does not have.
        for chunk in self.model.unwrapped():
            if chunk.vocab_size != self.model.shape.vocab_size:
                raise ValueError(
                    f"the model's vocabulary is padded to {chunk.vocab_size} entries (checkpoint: "
                    f"{self.model.shape.vocab_size}); logprobs need the unpadded vocabulary"
                )

    def _require_onloaded(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{what} needs the model on the device; call onload() first")


def token_logprobs(logits: torch.Tensor, micro_batch: MicroBatch, *,
                   temperature: float) -> torch.Tensor:
    """Token-aligned log-probabilities ``[rows, seq]`` (fp32) from vocab-parallel logits.

    ``logits[:, t]`` predicts ``labels[:, t] = tokens[:, t + 1]``; the result is shifted one to
    the right so that column ``t`` scores token ``t``, and is 0 outside ``valid_mask``. Under
    tensor parallelism the log-softmax spans all vocabulary shards.
    """
    from megatron.core import tensor_parallel

    # A fresh fp32 tensor: vocab_parallel_cross_entropy subtracts the max from its input in place.
    scaled = logits.float() / temperature
    label_logprobs = -tensor_parallel.vocab_parallel_cross_entropy(scaled, micro_batch["labels"])
    shifted = torch.nn.functional.pad(label_logprobs[:, :-1], (1, 0))
    return torch.where(micro_batch["valid_mask"] > 0, shifted, 0.0)

