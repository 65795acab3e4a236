"""The refit engine: move exported weights into an inference engine, fast and checked.

This module is the package's front: code outside ``mcore_refit/refit/`` imports from here only
(a lint rule enforces it). The map of the modules behind it is in ``README.md``.
"""

from mcore_refit.refit.buffers import StreamedSlots, packed_offsets, typed_view
from mcore_refit.refit.checksum import (
    DigestRecorder,
    TensorDigester,
    mismatched_names,
    verify_engine_weights,
)
from mcore_refit.refit.config import (
    DEFAULT_SLOT_BYTES,
    Fanout,
    PlanConfig,
    RefitConfig,
    TransportOptions,
)
from mcore_refit.refit.endpoint import (
    ColocatedInitInfo,
    EngineEndpoint,
    NonColocatedInitInfo,
    WeightTransferEndpoint,
    init_info_from_dict,
)
from mcore_refit.refit.engines import (
    HFModelEngine,
    NamedTensorEngine,
    TensorDictEngine,
    WeightLoader,
    check_received,
)
from mcore_refit.refit.errors import RefitError, RefitTimeout
from mcore_refit.refit.export import ModelExport
from mcore_refit.refit.plan import PlannedBuffer, RefitPlan, build_plan, plan_from_json
from mcore_refit.refit.refitter import Refitter, plan_for_source
from mcore_refit.refit.source import (
    LocalSource,
    Piecewise,
    RefitPass,
    RefitSource,
    SourceLayout,
    WeightSource,
)
from mcore_refit.refit.specs import Region, TensorSpec, spec_from_json, spec_to_json
from mcore_refit.refit.streams import DeviceMemoryProbe, DeviceStreams
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports import (
    create_receiver,
    create_sender,
    receiver_class,
    register_transport,
    sender_class,
    transport_for,
    transport_names,
)
from mcore_refit.refit.transports.base import RefitReceiver, RefitSender
from mcore_refit.refit.transports.collectives import GroupCollectives
from mcore_refit.refit.transports.colocated.receiver import ColocatedReceiver
from mcore_refit.refit.transports.colocated.sender import ColocatedSender
from mcore_refit.refit.transports.colocated.shared_weights import (
    SharedMemoryParameters,
    SharedWeightsSender,
)
from mcore_refit.refit.transports.non_colocated.placement import Placement
from mcore_refit.refit.transports.non_colocated.receiver import NonColocatedReceiver
from mcore_refit.refit.transports.non_colocated.sender import NonColocatedSender

__all__ = [
    "DEFAULT_SLOT_BYTES",
    "ColocatedInitInfo",
    "ColocatedReceiver",
    "ColocatedSender",
    "DeviceMemoryProbe",
    "DeviceStreams",
    "DigestRecorder",
    "EngineEndpoint",
    "Fanout",
    "GroupCollectives",
    "HFModelEngine",
    "LocalSource",
    "ModelExport",
    "NamedTensorEngine",
    "NonColocatedInitInfo",
    "NonColocatedReceiver",
    "NonColocatedSender",
    "Piecewise",
    "Placement",
    "PlanConfig",
    "PlannedBuffer",
    "RefitConfig",
    "RefitError",
    "RefitPass",
    "RefitPlan",
    "RefitReceiver",
    "RefitSender",
    "RefitSource",
    "RefitTelemetry",
    "RefitTimeout",
    "Refitter",
    "Region",
    "SharedMemoryParameters",
    "SharedWeightsSender",
    "SourceLayout",
    "StreamedSlots",
    "TensorDictEngine",
    "TensorDigester",
    "TensorSpec",
    "TransportOptions",
    "WeightLoader",
    "WeightSource",
    "WeightTransferEndpoint",
    "build_plan",
    "check_received",
    "create_receiver",
    "create_sender",
    "init_info_from_dict",
    "mismatched_names",
    "packed_offsets",
    "plan_for_source",
    "plan_from_json",
    "receiver_class",
    "register_transport",
    "sender_class",
    "spec_from_json",
    "spec_to_json",
    "transport_for",
    "transport_names",
    "typed_view",
    "verify_engine_weights",
]
