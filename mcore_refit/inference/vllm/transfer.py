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

import torch

from mcore_refit.inference.vllm.backend import BACKEND_NAME, RefitInitRequest
from mcore_refit.refit import (
    ColocatedInitInfo,
    EngineEndpoint,
    NonColocatedInitInfo,
    RefitPlan,
    RefitTelemetry,
    TransportOptions,
)


class VllmWeightTransfer(EngineEndpoint):
    """Refits into ``llm`` (a ``vllm.LLM`` built with :func:`~.backend.weight_transfer_config`).

    ``plan``: the plan the engine expects (``None`` adopts the trainer's); a trainer with
    another plan is refused (:class:`~mcore_refit.refit.RefitError` naming both fingerprints).
    Call :meth:`close`.
    """

    # vLLM's worker closed its update when update_weights raised (the backend finished its
    # reload then): after a failure nothing is left to finish there.
    weights_owner = "vLLM's"

    def __init__(self, llm, *, device: torch.device, options: TransportOptions,
                 plan: RefitPlan | None = None) -> None:
        config = llm.llm_engine.vllm_config.weight_transfer_config
        if config is None or config.backend != BACKEND_NAME:
            raise ValueError(f"the vLLM engine was built with weight_transfer_config="
                             f"{config!r}; build it with "
                             "mcore_refit.inference.vllm.backend.weight_transfer_config()")
        super().__init__(device=device, options=options, plan=plan)
        self._llm = llm

    @property
    def plan(self) -> RefitPlan | None:
        """The plan in use by vLLM's worker (the given one until the trainer sent its own)."""
        if not self._connected:
            return self._plan
        return self._backend_state(lambda backend: backend.plan)

    def _connect(self, init_info: ColocatedInitInfo | NonColocatedInitInfo) -> None:
        request = RefitInitRequest(transport=init_info, options=self._options, plan=self._plan)
        worker_device = self._backend_state(lambda backend: backend.device)
        if torch.device(worker_device).type != self._device.type:
            raise ValueError(f"device={self._device} but vLLM's worker runs on {worker_device}")
        self._llm.init_weight_transfer_engine({"init_info": vars(request)})

    def _begin(self) -> None:
        # vLLM's layerwise reload takes over the model's weight loaders.
        self._llm.start_weight_update()

    def _receive(self) -> RefitTelemetry:
        self._llm.update_weights({"update_info": {}})
        # Its ``engine`` figures: vLLM's own time in the refit, its loader calls, and how long
        # the last buffer waited for vLLM's loads.
        return self._backend_state(lambda backend: backend.last_telemetry)

    def _finish(self) -> None:
        self._llm.finish_weight_update()

    def _disconnect(self) -> None:
        self._backend_state(lambda backend: backend.shutdown())

    def _backend_state(self, read):
        """``read(backend)`` in vLLM's (one, in-process) worker."""
        results = self._llm.collective_rpc(
            lambda worker: read(worker.weight_transfer_engine))
        if len(results) != 1:
            raise RuntimeError(f"the vLLM engine has {len(results)} workers; the mcore_refit "
                               "backend serves one worker in this process")
        return results[0]
