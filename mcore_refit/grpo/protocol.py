"""The seam between the GRPO loop and whatever generates its rollouts: :class:`Rollouts`.

The loop (:mod:`mcore_refit.grpo.loop`) calls these four methods and nothing else. The two
backends in :mod:`mcore_refit.grpo.rollouts` implement them: engines colocated with the trainer
ranks (:class:`~mcore_refit.grpo.rollouts.ColocatedRollouts`) and the inference ranks of a
non-colocated job (:class:`~mcore_refit.grpo.rollouts.NonColocatedRollouts`).

An external engine plugs in the same way. A vLLM server, for instance, already exposes the four
calls our engine side mirrors (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``): its backend sends prompts to the server in
:meth:`Rollouts.generate` and returns :class:`~mcore_refit.inference.engine.Completion` objects
with the sampler's per-token logprobs; :meth:`Rollouts.refit` drives a
:class:`~mcore_refit.refit.Refitter` whose sender speaks the server's weight-transfer protocol
(for example a :class:`~mcore_refit.refit.NonColocatedSender` over a process group the server
joins in ``init_weight_transfer_engine``) and returns the sender's
:class:`~mcore_refit.refit.RefitTelemetry`; :meth:`Rollouts.release` asks the server
to sleep (or does nothing on dedicated GPUs).

Every method is a collective over the trainer ranks: call on every trainer rank, same order; a
failure on any rank is raised on every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mcore_refit.inference.engine import Completion, SamplingConfig
from mcore_refit.refit import RefitTelemetry


class Rollouts(Protocol):
    """Generates completions with the latest weights it received, and receives new weights."""

    def generate(self, prompts: Sequence[str], *, num_samples: int, sampling: SamplingConfig,
                 seed: int) -> list[list[Completion]]:
        """``num_samples`` completions per prompt, ``prompts`` order, the same on every trainer
        rank; each carries its token ids and the sampler's logprob of each token. The engines
        sample from ``seed`` (each with one derived from it and its shard), so the same
        weights, prompts and seed give the same completions: a resumed run's steps equal an
        uninterrupted run's."""
        ...

    def release(self) -> None:
        """Free what the engines hold on the trainers' devices before a training step (their
        weights and KV cache), where they share them; a no-op otherwise."""
        ...

    def refit(self, *, weight_version: int, verify: bool) -> RefitTelemetry:
        """Load the trainer's current weights into every engine and label them
        ``weight_version``; with ``verify``, check the engines' copy against the trainer's.
        Returns this trainer rank's measurements of the refit."""
        ...

    def close(self, *, failed: bool = False) -> None:
        """Stop the engines (or detach from them) and free the refit's buffers. After a failure
        (``failed``) this must not wait on peers that may be gone, nor hide the failure."""
        ...
