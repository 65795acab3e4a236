"""Trainer side of refits: a weight source, a plan, a transport.

    plan = plan_for_source(source, config=config.refit, device=device)
    sender = make_sender(config=config.refit, plan=plan, device=device, group=group, src_rank=0)
    with Refitter(source=source, sender=sender) as refitter:
        refitter.prepare()
        for step in ...:
            train_step(...)
            telemetry = refitter.refit()
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_refit.refit.broadcast import BroadcastSender
from mcore_refit.refit.config import RefitConfig
from mcore_refit.refit.ipc import IpcSender
from mcore_refit.refit.plan import RefitPlan, build_plan
from mcore_refit.refit.source import TensorSpec, WeightSource
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transport import RefitSender

logger = logging.getLogger(__name__)


def plan_for_source(source: WeightSource, *, config: RefitConfig,
                    device: torch.device) -> RefitPlan:
    """The refit plan for ``source``'s tensors under ``config``.

    Calls ``source.weight_specs()``, which may be collective: call on every trainer rank.
    """
    return plan_for_specs(source.weight_specs(), config=config, device=device)


def plan_for_specs(specs: Sequence[TensorSpec], *, config: RefitConfig,
                   device: torch.device) -> RefitPlan:
    """The refit plan for ``specs`` under ``config`` (buffer size resolved for ``device``)."""
    return build_plan(specs, buffer_bytes=config.resolve_buffer_bytes(torch.device(device)),
                      num_slots=config.num_buffers, alignment_bytes=config.alignment_bytes)


def make_sender(*, config: RefitConfig, plan: RefitPlan, device: torch.device,
                group: dist.ProcessGroup | None = None, src_rank: int = 0,
                cpu_device_id: str | None = None) -> RefitSender:
    """The transport ``config.mode`` names: broadcast over ``group`` from group rank
    ``src_rank`` (non-colocated), or an IPC socket for an engine on this device (colocated)."""
    device = torch.device(device)
    if config.mode == "non_colocated":
        return BroadcastSender(plan=plan, group=group, src_rank=src_rank, device=device,
                               config=config)
    return IpcSender(plan=plan, device=device, config=config, cpu_device_id=cpu_device_id)


class Refitter:
    """Pushes ``source``'s weights through ``sender`` once per :meth:`refit`. Owns the sender."""

    def __init__(self, *, source: WeightSource, sender: RefitSender) -> None:
        self.source = source
        self.sender = sender
        self._num_refits = 0

    @property
    def plan(self) -> RefitPlan:
        return self.sender.plan

    def prepare(self) -> None:
        """Allocate buffers and meet the engine (collective for the broadcast transport)."""
        self.sender.prepare()

    def refit(self, *, verify: bool = False) -> RefitTelemetry:
        """Export, pack and send the weights once; with ``verify``, check the engine's copy.

        Iterates the source (collective for the Megatron export: call on every trainer rank).
        Raises :class:`~mcore_refit.refit.transport.RefitError` if any side failed.
        """
        refit_index = self._num_refits
        self._num_refits += 1
        # Sources whose tensors outlive the next item (resident tensors) say so with a
        # ``stable_tensors = True`` attribute; their buffers are packed in batches.
        telemetry = self.sender.send(self.source.iter_weights(), refit_index=refit_index,
                                     verify=verify,
                                     stable_tensors=getattr(self.source, "stable_tensors", False))
        logger.info("refit %s", json.dumps(telemetry.as_dict()))
        return telemetry

    def close(self) -> None:
        self.sender.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
