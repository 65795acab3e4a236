"""The refit engine: move exported weights into an inference engine, fast and checked.

Layers, top to bottom (a reader finds the right file from this list):

- ``refitter.py``     trainer entry point: plan for a source, refit through a sender;
- ``receiver.py``     engine entry point with vLLM's weight-transfer call names;
- ``export.py``       the Megatron model as a source: each rank exports what it holds (and
                      Megatron-Bridge's own export, the baseline);
- ``broadcast.py``    non-colocated transport: each buffer from its source trainer rank to the
                      inference ranks (a broadcast group per source; IPC on a shared device);
- ``ipc_sender.py``, ``ipc_receiver.py``  colocated transport (ZMQ REQ/REP + CUDA IPC / shared
                      memory), ``ipc_memory.py`` its private directory and buffer sharing,
                      ``wire.py`` its typed messages;
- ``producer.py``     filling a source rank's buffers (pack, header, checksum, digests);
- ``rounds.py``       the start and finish exchanges of every refit, over the control plane;
- ``group.py``        bounded device collectives over one process group;
- ``buffers.py``      persistent slots, headers, pack/unpack;
- ``plan.py``         the pure layout (tensors, buffers, sources, slots) and its fingerprint;
- ``source.py``       the source protocols (one-rank weight sources, sharded sources);
- ``checksum.py``     exact buffer checksums and per-tensor digests (verification);
- ``telemetry.py``, ``streams.py``, ``transport.py`` (base classes and errors), ``config.py``;
- ``engines.py``      reference engines (HF model, tensor dict).
"""

from mcore_refit.refit.broadcast import BroadcastReceiver, BroadcastSender
from mcore_refit.refit.config import PlanConfig, RefitConfig, TransportOptions
from mcore_refit.refit.engines import HFModelEngine, NamedTensorEngine, TensorDictEngine
from mcore_refit.refit.ipc_receiver import IpcReceiver
from mcore_refit.refit.ipc_sender import IpcSender
from mcore_refit.refit.ipc_shared import SharedWeightsSender, colocated_sender
from mcore_refit.refit.plan import RefitPlan, TensorSpec, build_plan, plan_from_json
from mcore_refit.refit.receiver import (
    BroadcastInitInfo,
    IpcInitInfo,
    WeightTransferEndpoint,
    init_info_from_dict,
)
from mcore_refit.refit.refitter import Refitter, plan_for_source
from mcore_refit.refit.source import LocalSource, RefitSource, WeightSource
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import RefitError, RefitReceiver, RefitSender, RefitTimeout

__all__ = [
    "BroadcastInitInfo",
    "BroadcastReceiver",
    "BroadcastSender",
    "HFModelEngine",
    "IpcInitInfo",
    "IpcReceiver",
    "IpcSender",
    "SharedWeightsSender",
    "colocated_sender",
    "LocalSource",
    "NamedTensorEngine",
    "PlanConfig",
    "RefitConfig",
    "RefitError",
    "RefitPlan",
    "RefitReceiver",
    "RefitSender",
    "RefitSource",
    "RefitTelemetry",
    "RefitTimeout",
    "Refitter",
    "TensorDictEngine",
    "TensorSpec",
    "TransportOptions",
    "WeightSource",
    "WeightTransferEndpoint",
    "build_plan",
    "init_info_from_dict",
    "plan_for_source",
    "plan_from_json",
]
