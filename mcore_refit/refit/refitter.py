"""Trainer side of refits: a source, a plan, a transport.

    plan = plan_for_source(source, config=config.refit.plan, device=device)   # collective
    sender = NonColocatedSender(plan=plan, ...) or ColocatedSender(plan=plan, ...)
    with Refitter(source=source, sender=sender) as refitter:
        refitter.prepare()
        for step in ...:
            train_step(...)
            telemetry = refitter.refit()
"""

from __future__ import annotations

import json
import logging

import torch

from mcore_refit.refit.config import PlanConfig
from mcore_refit.refit.plan import RefitPlan, build_plan
from mcore_refit.refit.source import RefitSource
from mcore_refit.refit.telemetry import RefitTelemetry
from mcore_refit.refit.transports.base import RefitSender

logger = logging.getLogger(__name__)


def plan_for_source(source: RefitSource, *, config: PlanConfig,
                    device: torch.device) -> RefitPlan:
    """The refit plan for ``source``'s tensors and source ranks under ``config``.

    Calls ``source.layout()``, which may be collective: call on every trainer rank.
    """
    layout = source.layout()
    return build_plan(layout.specs, sources=layout.sources,
                      slot_bytes=config.resolve_slot_bytes(torch.device(device)),
                      num_slots=config.num_slots, alignment_bytes=config.alignment_bytes)


class Refitter:
    """Pushes ``source``'s weights through ``sender`` once per :meth:`refit`. Owns the sender."""

    def __init__(self, *, source: RefitSource, sender: RefitSender) -> None:
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

        Collective over the trainer ranks (and, for the broadcast transport, the inference
        ranks). Raises :class:`~mcore_refit.refit.errors.RefitError` if any rank failed.
        """
        refit_index = self._num_refits
        self._num_refits += 1
        telemetry = self.sender.send(self.source.begin(self.plan), refit_index=refit_index,
                                     verify=verify)
        telemetry.held_bytes += getattr(self.source, "held_bytes", 0)
        logger.info("refit %s", json.dumps(telemetry.as_dict()))
        return telemetry

    def close(self) -> None:
        self.sender.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
