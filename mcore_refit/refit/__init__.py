"""The refit engine: move exported weights into an inference engine, fast and checked.

Layers, top to bottom (a reader finds the right file from this list):

- ``refitter.py``   trainer entry point: plan for a source, pick the transport, refit;
- ``receiver.py``   engine entry point with vLLM's weight-transfer call names;
- ``broadcast.py``  non-colocated transport (process-group broadcast, N slots overlapped);
  ``group.py``      its bounded collectives and start/finish exchanges;
- ``ipc.py``        colocated transport (ZMQ REQ/REP + CUDA IPC / shared memory);
  ``ipc_memory.py`` private socket directory and buffer sharing; ``wire.py`` message format;
- ``buffers.py``    persistent packed buffers, headers, pack/unpack;
- ``plan.py``       the pure layout and its fingerprint;
- ``checksum.py``   exact buffer checksums and per-tensor digests (verification);
- ``telemetry.py``, ``streams.py``, ``transport.py`` (base classes and errors), ``config.py``;
- ``engines.py``    reference engines (HF model, tensor dict); ``synthetic.py`` test sources.
"""

from mcore_refit.refit.config import RefitConfig
from mcore_refit.refit.engines import HFModelEngine, NamedTensorEngine, TensorDictEngine
from mcore_refit.refit.plan import RefitPlan, build_plan, plan_from_json
from mcore_refit.refit.receiver import (
    BroadcastInitInfo,
    IpcInitInfo,
    WeightTransferEndpoint,
    init_info_from_dict,
)
from mcore_refit.refit.refitter import Refitter, make_sender, plan_for_source
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import (
    RefitError,
    RefitReceiver,
    RefitSender,
    RefitTimeout,
    WeightLoader,
)

__all__ = [
    "BroadcastInitInfo",
    "HFModelEngine",
    "IpcInitInfo",
    "NamedTensorEngine",
    "RefitConfig",
    "RefitError",
    "RefitPlan",
    "RefitReceiver",
    "RefitSender",
    "RefitTelemetry",
    "RefitTimeout",
    "Refitter",
    "TensorDictEngine",
    "WeightLoader",
    "WeightTransferEndpoint",
    "build_plan",
    "init_info_from_dict",
    "make_sender",
    "plan_for_source",
    "plan_from_json",
]
