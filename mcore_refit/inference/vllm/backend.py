"""mcore_refit's transports as a vLLM weight-transfer backend, run inside vLLM's worker.

vLLM (0.25) drives weight updates through its worker's ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` and ``finish_weight_update``, each delegated to the
backend named by ``LLM(weight_transfer_config=WeightTransferConfig(backend=...))`` and created
by ``WeightTransferEngineFactory``. :func:`register_backend` registers :class:`RefitBackend`
there as ``"mcore_refit"``; :func:`weight_transfer_config` registers it and returns the config
to build the ``LLM`` with (registration must precede the ``LLM``: the worker creates its backend
while loading the model).

The backend runs one of the project's receivers — colocated: ZMQ + CUDA IPC (shared memory on
CPU) from the trainer on this device; non-colocated: a broadcast from each source trainer rank
(IPC from a source on this device) — and writes through :class:`VllmModelLoader` into vLLM's
own loader. One ``update_weights`` call receives one whole refit. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker): the init info carries live objects (process
groups), which vLLM's ``collective_rpc`` hands to the worker as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from mcore_refit.inference.vllm.loader import VllmModelLoader
from mcore_refit.inference.vllm.verification import ReferenceModel
from mcore_refit.refit import (
    ColocatedInitInfo,
    NonColocatedInitInfo,
    RefitPlan,
    RefitReceiver,
    RefitTelemetry,
    TransportOptions,
)

BACKEND_NAME = "mcore_refit"


@dataclass(kw_only=True)
class RefitInitRequest(WeightTransferInitInfo):
    """What the worker needs to connect: the transport's init info, its options, and the plan
    the engine expects (``None``: adopt the trainer's)."""

    transport: ColocatedInitInfo | NonColocatedInitInfo
    options: TransportOptions
    plan: RefitPlan | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.transport, ColocatedInitInfo | NonColocatedInitInfo):
            raise ValueError(f"init_info.transport must be an ColocatedInitInfo or a "
                             f"NonColocatedInitInfo, got {type(self.transport).__name__}")
        if not isinstance(self.options, TransportOptions):
            raise ValueError(f"init_info.options must be TransportOptions, got "
                             f"{type(self.options).__name__}")


@dataclass(kw_only=True)
class RefitUpdateRequest(WeightTransferUpdateInfo):
    """One ``update_weights`` receives one whole refit; nothing to say per update."""


class RefitBackend(WeightTransferEngine[RefitInitRequest, RefitUpdateRequest]):
    """vLLM's view of an mcore_refit receiver (one per vLLM worker)."""

    init_info_cls = RefitInitRequest
    update_info_cls = RefitUpdateRequest

    def __init__(self, config: WeightTransferConfig, vllm_config, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: RefitReceiver | None = None
        self._timeout_s = 0.0
        self.loader = VllmModelLoader(
            model=model, model_config=vllm_config.model_config, device=device,
            plan_of=lambda: self._receiver.plan if self._receiver is not None else None,
            reference=lambda: ReferenceModel.build(vllm_config, device))
        self.last_telemetry: RefitTelemetry | None = None

    @property
    def plan(self) -> RefitPlan | None:
        return self._receiver.plan if self._receiver is not None else None

    def init_transfer_engine(self, init_info: RefitInitRequest) -> None:
        """Connect the receiver (for a broadcast: collective with the trainers' prepare)."""
        if self._receiver is not None:
            raise RuntimeError("the mcore_refit weight transfer is already initialised")
        self._receiver = init_info.transport.open(device=self.device, options=init_info.options,
                                                  plan=init_info.plan)
        self._timeout_s = init_info.options.timeout_s

    def start_weight_update(self) -> None:
        if self._receiver is None:
            raise RuntimeError("call init_weight_transfer_engine before start_weight_update")
        self.last_telemetry = None
        self.loader.begin(timeout_s=self._timeout_s)

    def receive_weights(self, update_info: RefitUpdateRequest) -> None:
        """Receive one refit (blocks until the trainer's refit completed, each wait bounded by
        the transport's timeouts); a failed refit still finishes vLLM's reload, so the model is
        whole (with partly old weights) and the worker can start the next update."""
        try:
            telemetry = self._receiver.receive(self.loader)
        except BaseException:
            self.loader.abandon()
            raise
        telemetry.held_bytes += self.loader.staging_bytes
        telemetry.engine = self.loader.figures()
        self.last_telemetry = telemetry

    def finish_weight_update(self) -> None:
        self.loader.end()

    def shutdown(self) -> None:
        self.loader.close()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args: dict[str, Any] | Any) -> None:
        raise NotImplementedError("the trainer side of the mcore_refit backend is "
                                  "mcore_refit.refit.Refitter with a sender of its transports")


def register_backend() -> None:
    """Register :class:`RefitBackend` with vLLM as ``"mcore_refit"`` (idempotent)."""
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, RefitBackend)


def weight_transfer_config() -> WeightTransferConfig:
    """The ``weight_transfer_config`` for ``LLM(...)`` that refits through this backend."""
    register_backend()
    return WeightTransferConfig(backend=BACKEND_NAME)
