"""Does a model and layout convert exactly? Export, loss and gradient parity against Hugging Face.

:func:`verify_export` builds nothing itself: it takes the Megatron chunks (built and DDP-wrapped by
the caller) and the checkpoint they came from, and checks three things:

1. every exported tensor equals the checkpoint's tensor bitwise, none missing, none unexpected;
2. one forward/backward through Megatron's pipeline schedule on a fixed batch gives the loss that
   the Hugging Face model gives on the same batch;
3. the gradients, exported through the bridge to HF names, match the HF model's gradients, for
   every HF parameter: a parameter whose gradient the export does not yield (or an exported
   gradient the HF model has no parameter for) fails the check by name. transformers' fused
   expert tensors are compared expert by expert (:mod:`mcore_refit.hf_experts`).

Mixture-of-experts models are built without the router's auxiliary losses
(``model.moe_aux_loss_coeff: 0``, the default), so both sides minimise the same loss.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mcore_refit import distributed
from mcore_refit.config import ModelConfig, ParallelConfig
from mcore_refit.hf_experts import expert_views, loading_options
from mcore_refit.model import ModelChunks, build_model
from mcore_refit.pipeline import MicroBatch, broadcast_from_last_stage, forward_backward

# Largest |difference| accepted for the loss and for any gradient element, by parameter dtype.
# fp32: both sides compute in fp32 and differ only in summation order (observed ~1e-6).
# bf16/fp16: Megatron computes in half precision, the HF reference in fp32 from the same weights.
TOLERANCES = {
    "float32": {"loss": 1e-5, "grad": 1e-5},
    "bfloat16": {"loss": 1e-2, "grad": 1e-2},
    "float16": {"loss": 1e-2, "grad": 1e-2},
}


@dataclass(kw_only=True)
class ExportReport:
    """Outcome of :func:`verify_export`; ``as_dict()`` is the verifier's JSON line."""

    tensors: int
    mismatched: list[str]
    missing: list[str]
    unexpected: list[str]
    loss_max_abs_diff: float
    grad_max_abs_diff: float
    tp: int
    pp: int
    vpp: int | None
    device: str
    dtype: str
    worst_grad: str | None = None
    ep: int = 1
    # Gradients compared with the HF model's (one per HF parameter, experts one by one); HF
    # parameters whose gradient the export did not yield; exported gradients of no HF parameter.
    grads_compared: int = 0
    grads_missing: list[str] = dataclasses.field(default_factory=list)
    grads_unexpected: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        tolerance = TOLERANCES[self.dtype]
        return (not self.mismatched and not self.missing and not self.unexpected
                and not self.grads_missing and not self.grads_unexpected
                and self.grads_compared > 0
                and self.loss_max_abs_diff <= tolerance["loss"]
                and self.grad_max_abs_diff <= tolerance["grad"])

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def verify_layout(model_config: ModelConfig, parallel: ParallelConfig, *, device: torch.device,
                  seed: int, num_micro_batches: int = 4, micro_batch_size: int = 2,
                  seq_length: int = 16) -> ExportReport:
    """Build ``model_config`` with ``parallel`` and run :func:`verify_export` on a fixed batch.

    Collective: call on every rank with the same arguments. Sets up Megatron's model-parallel
    state for ``parallel`` and tears it down again, so one process can verify several layouts.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    model_parallel = distributed.init_model_parallel(parallel, seed=seed)
    try:
        model = build_model(model_config, model_parallel, device=device, wrap_with_ddp=True,
                            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        micro_batches = fixed_batch(
            vocab_size=model.shape.vocab_size, num_micro_batches=num_micro_batches,
            micro_batch_size=micro_batch_size, seq_length=seq_length, seed=seed, device=device,
            pad_token_id=model.shape.pad_token_id,
        )
        return verify_export(model, micro_batches=micro_batches, device=device)
    finally:
        distributed.destroy_model_parallel()


def fixed_batch(*, vocab_size: int, num_micro_batches: int, micro_batch_size: int,
                seq_length: int, seed: int, device: torch.device,
                pad_token_id: int | None = None) -> list[MicroBatch]:
    """Deterministic random token micro-batches (identical on every rank for the same seed).

    ``pad_token_id`` never occurs: HF embeddings built with ``padding_idx`` give that row no
    gradient while Megatron's do, which is a training-semantics difference, not a conversion error.
    """
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_length).expand(micro_batch_size, seq_length)
    micro_batches = []
    for _ in range(num_micro_batches):
        sequence = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1),
                                 generator=generator)
        if pad_token_id is not None:
            sequence[sequence == pad_token_id] = (pad_token_id + 1) % vocab_size
        micro_batches.append({
            "tokens": sequence[:, :-1].to(device),
            "labels": sequence[:, 1:].to(device),
            "position_ids": positions.to(device),
        })
    return micro_batches


def verify_export(model: ModelChunks, *, micro_batches: list[MicroBatch],
                  device: torch.device) -> ExportReport:
    """Check ``model`` (DDP-wrapped, fresh from its checkpoint) against its HF checkpoint.

    Collective: call on every rank with the same micro-batches. Runs one forward/backward, so the
    chunks hold gradients afterwards. Every rank returns the same report.
    """
    reference = hf_reference_state(model.model_config.hf_path)
    num_tensors, mismatched, missing, unexpected = compare_export(model, reference)
    losses = _megatron_losses(model, micro_batches, device)
    grads = _export_gradients(model)
    ref_losses, ref_grads = _hf_losses_and_gradients(model.model_config.hf_path, micro_batches,
                                                     device)
    grad_diffs = {name: (grads[name] - ref_grads[name]).abs().max().item()
                  for name in ref_grads if name in grads}
    worst = max(grad_diffs, key=grad_diffs.get) if grad_diffs else None
    parallel = model.parallel
    return ExportReport(
        tensors=num_tensors,
        mismatched=mismatched,
        missing=missing,
        unexpected=unexpected,
        loss_max_abs_diff=(losses - ref_losses).abs().max().item(),
        grad_max_abs_diff=grad_diffs[worst] if worst is not None else float("inf"),
        tp=parallel.tensor,
        pp=parallel.pipeline,
        vpp=parallel.virtual_pipeline,
        device=device.type,
        dtype=model.model_config.dtype,
        worst_grad=worst,
        ep=parallel.expert,
        grads_compared=len(grad_diffs),
        grads_missing=sorted(set(ref_grads) - set(grads)),
        grads_unexpected=sorted(set(grads) - set(ref_grads)),
    )


def compare_export(model: ModelChunks, reference: dict[str, torch.Tensor]
                   ) -> tuple[int, list[str], list[str], list[str]]:
    """Export ``model`` and compare each tensor bitwise with ``reference`` (HF name → tensor).

    Collective (the export). Returns (tensors exported, mismatched, missing, unexpected) with
    sorted name lists. A reference of another dtype than the model's is cast to the exported
    dtype first (an fp32 checkpoint loaded into a bf16 model must export its bf16 rounding); a
    shape difference counts as mismatched.
    """
    seen, mismatched, unexpected = set(), [], []
    for name, tensor in model.export_hf_weights():
        seen.add(name)
        expected = reference.get(name)
        if expected is None:
            unexpected.append(name)
        elif not torch.equal(tensor.detach().cpu(), expected.to(tensor.dtype)):
            mismatched.append(name)
    missing = sorted(set(reference) - seen)
    return len(seen), sorted(mismatched), missing, sorted(unexpected)


def _megatron_losses(model: ModelChunks, micro_batches: list[MicroBatch],
                     device: torch.device) -> torch.Tensor:
    """Per-micro-batch mean token loss from one training forward/backward, on every rank."""
    from megatron.core.distributed import finalize_model_grads

    config = model.transformer_config
    config.finalize_model_grads_func = finalize_model_grads
    model.train()
    for chunk in model.chunks:
        chunk.zero_grad_buffer()

    def mean_token_loss(per_token: torch.Tensor, micro_batch: MicroBatch):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    outputs = forward_backward(model, micro_batches, loss_func=mean_token_loss,
                               forward_only=False)
    local = torch.stack([out["loss"] for out in outputs]) if outputs else None
    return broadcast_from_last_stage(local, model_parallel=model.model_parallel,
                                     shape=(len(micro_batches),), dtype=torch.float32,
                                     device=device).cpu()


def _export_gradients(model: ModelChunks) -> dict[str, torch.Tensor]:
    """Gradients in HF layout: export once with each parameter's data swapped for its main_grad.

    The bridge reads parameter ``.data`` through its cached tasks, so the swap reuses the exact
    export path (TP gather, PP broadcast, QKV and gate/up splits) for gradients.
    """
    params = list(model.parameters())
    saved = [param.data for param in params]
    try:
        for param in params:
            grad = getattr(param, "main_grad", None)
            if grad is None:
                raise RuntimeError("verify_export needs DDP-wrapped chunks (param.main_grad)")
            # The export's pipeline broadcast sizes its receive buffers from the model's dtype, so
            # half-precision models export their (fp32) gradients rounded to that dtype.
            param.data = grad.to(param.dtype)
        return {name: tensor.detach().float().cpu().clone()
                for name, tensor in model.export_hf_weights()}
    finally:
        for param, data in zip(params, saved):
            param.data = data


def _hf_losses_and_gradients(hf_path: str, micro_batches: list[MicroBatch],
                             device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The HF model's per-micro-batch loss and gradients (fp32) for the same objective, one per
    HF parameter (zeros for a parameter the batch did not reach; fused experts one by one)."""
    hf_model = AutoModelForCausalLM.from_pretrained(
        hf_path, dtype=torch.float32, **loading_options(torch.float32)).to(device)
    hf_model.train()
    losses = []
    for micro_batch in micro_batches:
        logits = hf_model(input_ids=micro_batch["tokens"],
                          position_ids=micro_batch["position_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 micro_batch["labels"].flatten())
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    grads = {name: (param.grad if param.grad is not None else torch.zeros_like(param))
             .detach().float().cpu() for name, param in hf_model.named_parameters()}
    grads = {name: grad.clone() for name, grad in expert_views(grads.items())}
    if hf_model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return torch.stack(losses).cpu(), grads


def hf_reference_state(hf_path: str) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint's safetensors files, by HF name, on the CPU."""
    files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {hf_path!r}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return state
