"""Refits into a running vLLM engine, through vLLM's own weight-transfer calls.

:class:`VllmWeightTransfer` is the engine-side control surface for a vLLM ``LLM`` — a drop-in for
:class:`~mcore_refit.refit.WeightTransferEndpoint` (same calls, same errors)::

    llm = LLM(model=..., weight_transfer_config=weight_transfer_config(), ...)
    transfer = VllmWeightTransfer(llm, device=device, options=cfg.refit.transport)
    transfer.init_weight_transfer_engine(ColocatedInitInfo(address=...))   # or NonColocatedInitInfo
    transfer.start_weight_update()
    telemetry = transfer.update_weights()     # one whole refit, into vLLM's loader
    transfer.finish_weight_update(weight_version=step)

Each call goes through ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` to the :class:`~.backend.RefitBackend` in vLLM's
worker. The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch

from mcore_refit.inference.vllm.backend import BACKEND_NAME, RefitInitRequest
from mcore_refit.refit import (
    ColocatedInitInfo,
    NonColocatedInitInfo,
    RefitError,
    RefitPlan,
    RefitTelemetry,
    TransportOptions,
    init_info_from_dict,
)

logger = logging.getLogger(__name__)


class VllmWeightTransfer:
    """Refits into ``llm`` (a ``vllm.LLM`` built with :func:`~.backend.weight_transfer_config`).

    ``plan``: the plan the engine expects (``None`` adopts the trainer's); a trainer with
    another plan is refused (:class:`~mcore_refit.refit.RefitError` naming both fingerprints).
    Call :meth:`close`.
    """

    def __init__(self, llm, *, device: torch.device, options: TransportOptions,
                 plan: RefitPlan | None = None) -> None:
        config = llm.llm_engine.vllm_config.weight_transfer_config
        if config is None or config.backend != BACKEND_NAME:
            raise ValueError(f"the vLLM engine was built with weight_transfer_config="
                             f"{config!r}; build it with "
                             "mcore_refit.inference.vllm.backend.weight_transfer_config()")
        self._llm = llm
        self._device = torch.device(device)
        self._options = options
        self._plan = plan
        self._initialised = False
        self._updating = False
        self._failed = False
        self._weight_version: int | None = None
        self.last_telemetry: RefitTelemetry | None = None

    @property
    def weight_version(self) -> int | None:
        """Version passed to the last successful :meth:`finish_weight_update`."""
        return self._weight_version

    @property
    def plan(self) -> RefitPlan | None:
        """The plan in use by vLLM's worker (the given one until the trainer sent its own)."""
        if not self._initialised:
            return self._plan
        return self._backend_state(lambda backend: backend.plan)

    def init_weight_transfer_engine(self, init_info: ColocatedInitInfo | NonColocatedInitInfo
                                    | Mapping[str, Any]) -> None:
        """Connect vLLM's worker to the trainer. For ``broadcast`` this is a collective with the
        trainer's ``prepare()``: call it on every inference rank while the trainer prepares."""
        if self._initialised:
            raise RuntimeError("init_weight_transfer_engine was already called")
        if isinstance(init_info, Mapping):
            init_info = init_info_from_dict(init_info)
        request = RefitInitRequest(transport=init_info, options=self._options, plan=self._plan)
        worker_device = self._backend_state(lambda backend: backend.device)
        if torch.device(worker_device).type != self._device.type:
            raise ValueError(f"device={self._device} but vLLM's worker runs on {worker_device}")
        self._llm.init_weight_transfer_engine({"init_info": vars(request)})
        self._initialised = True

    def start_weight_update(self) -> None:
        """Start an update (vLLM's layerwise reload takes over the model's weight loaders)."""
        if not self._initialised:
            raise RuntimeError("call init_weight_transfer_engine before start_weight_update")
        if self._updating:
            raise RuntimeError("a weight update is already in progress")
        self._llm.start_weight_update()
        self._updating, self._failed = True, False

    def update_weights(self, update_info: Mapping[str, Any] | None = None) -> RefitTelemetry:
        """Receive one refit into vLLM; blocks until the trainer's refit completed.

        ``update_info`` must be empty. Raises :class:`~mcore_refit.refit.RefitError` when the
        refit failed on any side (vLLM's model then holds partly old weights and keeps its
        previous version label).
        """
        if not self._updating:
            raise RuntimeError("call start_weight_update before update_weights")
        if update_info:
            raise ValueError(f"unknown update_info key '{sorted(update_info)[0]}'")
        try:
            self._llm.update_weights({"update_info": {}})
        except BaseException:
            self._failed = True
            raise
        self.last_telemetry, vllm_load_s, vllm_wait_s = self._backend_state(
            lambda backend: (backend.last_telemetry, backend.loader.vllm_load_s,
                             backend.loader.vllm_wait_s))
        # vLLM's own time in the refit, and how much of it came after the last buffer arrived.
        logger.info("refit %s vllm_load_s=%.6f vllm_wait_s=%.6f",
                    json.dumps(self.last_telemetry.as_dict()), vllm_load_s, vllm_wait_s)
        return self.last_telemetry

    def finish_weight_update(self, weight_version: int) -> None:
        """Label the loaded weights ``weight_version``; refuses after a failed update."""
        if not self._updating:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self._updating = False
        if self._failed:
            # vLLM's worker closed its update when update_weights raised (the backend finished
            # its reload then); nothing is left to finish there.
            raise RefitError(f"the update to weight version {weight_version} failed; vLLM's "
                             "weights are partial and keep their previous version label")
        self._llm.finish_weight_update()
        self._weight_version = weight_version

    def close(self) -> None:
        """Disconnect the worker's receiver (the engine keeps running). Idempotent."""
        if self._initialised:
            self._backend_state(lambda backend: backend.shutdown())
            self._initialised = False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _backend_state(self, read):
        """``read(backend)`` in vLLM's (one, in-process) worker."""
        results = self._llm.collective_rpc(
            lambda worker: read(worker.weight_transfer_engine))
        if len(results) != 1:
            raise RuntimeError(f"the vLLM engine has {len(results)} workers; the mcore_refit "
                               "backend serves one worker in this process")
        return results[0]
