"""vLLM as the benchmark's engine (``bench.engine: vllm``): refits land in a vLLM engine in the
receiving process, and ``vllm_load_floor`` times vLLM's own load of the same tensors (whole HF
tensors already in memory on its device, through the layerwise reload a refit uses): the floor
a refit into vLLM is measured against, in the same run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from mcore_refit.refit import TransportOptions

# The benchmark engine's KV cache: one request of max_model_len (128) tokens of Llama-3-8B is
# 32 MiB (32 layers x 8 KV heads x 128 x K and V in bf16); the rest is margin.
KV_CACHE_BYTES = 256 << 20


def refittable_llm(hf_path: str | Path, *, dtype: str = "float32", seed: int = 0,
                   max_model_len: int = 128, kv_cache_bytes: int = 32 << 20,
                   load_format: str = "auto", gpu_memory_utilization: float = 0.3,
                   device: torch.device | None = None):
    """``vllm.LLM`` over ``hf_path`` that refits through the mcore_refit backend: eager, a KV
    cache of ``kv_cache_bytes``; ``load_format="dummy"`` skips the checkpoint's weights (a
    config-only directory will do: the refit brings the weights, and no tokenizer is loaded).
    On GPU, ``device`` (``cuda:N``) is the GPU vLLM runs on (its ``device_ids``: vLLM would
    otherwise take the process's first visible GPU), and ``gpu_memory_utilization`` of it must
    be free at start-up. The caller sets
    vLLM's environment first (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine in this
    process)."""
    import torch.distributed as dist
    from vllm import LLM

    from mcore_refit.inference.vllm.backend import weight_transfer_config

    if not dist.is_initialized():
        # vLLM makes a process group of its own (a world of one, at a tcp:// address it picks).
        # In a process spawned by a torchrun rank (a colocated engine), torchrun's
        # TORCHELASTIC_USE_AGENT_STORE would make that rendezvous a client of a store nobody
        # serves at that address: it waits until its timeout.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    placement = {}
    if device is not None and torch.device(device).type == "cuda":
        placement["device_ids"] = [torch.device(device).index or 0]
    return LLM(model=str(hf_path), enforce_eager=True, dtype=dtype, seed=seed, **placement,
               max_model_len=max_model_len, max_num_seqs=4, kv_cache_memory_bytes=kv_cache_bytes,
               load_format=load_format, skip_tokenizer_init=load_format == "dummy",
               gpu_memory_utilization=gpu_memory_utilization,
               weight_transfer_config=weight_transfer_config())


def vllm_engine_args(job) -> dict:
    """The :class:`VllmBenchEngine` arguments of a benchmark job with ``bench.engine=vllm``:
    its Megatron model's HF config (``megatron.hf_path``, or the preset's config written here),
    dtype, and the GPU memory that must be free."""
    from mcore_refit.bench.sources import write_preset_config

    megatron = job.megatron
    hf_path = megatron.hf_path or write_preset_config(megatron.preset,
                                                       num_layers=megatron.num_layers)
    return {"hf_path": hf_path, "dtype": megatron.dtype,
            "gpu_memory_utilization": job.bench.vllm_gpu_memory_utilization}


class VllmBenchEngine:
    """A vLLM engine over ``hf_path`` with dummy weights, receiving the benchmark's refits."""

    def __init__(self, hf_path: str, *, device: torch.device, dtype: str,
                 options: TransportOptions, gpu_memory_utilization: float) -> None:
        self.device = torch.device(device)
        self.options = options
        self.llm = refittable_llm(hf_path, dtype=dtype, load_format="dummy",
                                  kv_cache_bytes=KV_CACHE_BYTES,
                                  gpu_memory_utilization=gpu_memory_utilization,
                                  device=self.device)
        # The last refit's tensors, whole, for the floor (see transfer()).
        self._last_refit: list[tuple[str, torch.Tensor]] = []

    def receive(self, init_info, *, num_refits: int, first_timed: int,
                num_timed: int) -> tuple[list[dict], str | None]:
        """``num_refits`` refits through ``init_info``'s transport; the receiver telemetry of
        the timed ones and the error that ended them early (``None`` if none did)."""
        from mcore_refit.bench.rank import receive_refits

        with self.transfer() as transfer:
            return receive_refits(transfer, init_info, num_refits=num_refits,
                                  first_timed=first_timed, num_timed=num_timed)

    @contextlib.contextmanager
    def transfer(self, options: TransportOptions | None = None) -> Iterator:
        """A ``VllmWeightTransfer`` into this engine, receiving with ``options`` (this engine's
        by default; a non-colocated benchmark passes the running mode's fan-out). When the
        block ends without an error, the last refit's tensors are kept for the floor, copied
        where vLLM read them in the trainer's memory or the transport's slots (gone with the
        transfer)."""
        from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

        with VllmWeightTransfer(self.llm, device=self.device,
                                options=options if options is not None else self.options
                                ) as transfer:
            yield transfer
            self._last_refit = []  # the old copies go before new ones are made
            self._last_refit = self.llm.collective_rpc(
                lambda worker: worker.weight_transfer_engine.loader.staged_weights(
                    copy_referred=True))[0]

    def load_floor(self, repetitions: int) -> tuple[list[float], int, list[dict]]:
        """Seconds of each of ``repetitions`` loads, by vLLM's loader, of the tensors the last
        refit brought (as the refit loads them: layerwise reload, whole HF tensors, on the
        loading thread of the refit's own loader; from ``load_weights`` to the finished
        reload), their bytes, and the loader's figures of each (as a refit's telemetry has
        them: ``load_cpu_s`` says whether a refit's loads did more work than these or waited).
        The thread matters on CPU: vLLM's worker binds its main thread's OpenMP threads to
        cores, and on a busy host a bound and an unbound thread load at different speeds;
        floor and refit load on the same one."""
        weights = self._last_refit

        def load(worker) -> tuple[list[float], int, list[dict]]:
            loader = worker.weight_transfer_engine.loader
            if not weights:
                raise RuntimeError("vllm_load_floor needs a refit mode before it (the floor "
                                   "loads the tensors the last refit brought)")
            times, figures = [], []
            for _ in range(repetitions):
                # The reload's set-up is left out of the floor (a refit's engine starts it in
                # start_weight_update, and it overlaps the transport's start there).
                loader.begin(timeout_s=self.options.timeout_s)
                loader.wait_until_set_up()
                _synchronize(worker.device)
                started = time.perf_counter()
                loader.load_from_memory(weights)
                _synchronize(worker.device)
                times.append(time.perf_counter() - started)
                figures.append(loader.figures())
            return times, sum(tensor.nbytes for _, tensor in weights), figures

        return self.llm.collective_rpc(load)[0]


def _synchronize(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
