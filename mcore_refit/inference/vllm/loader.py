"""The refit's engine end inside a vLLM worker: received tensors into vLLM's own loader.

:class:`VllmModelLoader` is the :class:`~mcore_refit.refit.WeightLoader` a refit
receiver writes into. Each refit runs vLLM's layerwise reload
(``vllm.model_executor.model_loader.reload``): :meth:`begin` puts every layer on the meta device
with its weight loaders wrapped, the model's own ``load_weights`` takes whole HF tensors (the
stacking of q/k/v and gate/up, sharding and padding stay vLLM's), and a layer is rebuilt, its
weights processed (on CPU: repacked for oneDNN) and copied into the tensors the engine computes
with once all its weights arrived; :meth:`end` finishes the layers still open. A plain
``model.load_weights`` into a running CPU engine fails (its linear weights are emptied after
processing), having half-updated ``lm_head`` first.

What the receiver hands over are views of transport slots, in general refilled right after, so
every tensor is first copied into :class:`~mcore_refit.inference.vllm.staging.RefitStaging`,
where pieces from tensor-parallel trainer ranks are assembled too; vLLM sees only staged
tensors. The copy is all that happens in the receiver's loop: vLLM's load of the staged tensors
runs on a :class:`~mcore_refit.inference.vllm.pipeline.LoadPipeline` thread while the next
buffers arrive. Two kinds of refit skip the copy of whole tensors (only pieces are assembled):
one whose plan gives every buffer a slot of its own, so that no slot is refilled before the
refit ends (:meth:`VllmModelLoader.load_weights_held`, buffer by buffer), and one from the
trainer's own memory, ``ipc_sharing: weights`` (:meth:`VllmModelLoader.load_weights_in_place`,
the whole refit in one call). vLLM's reload is finished before the refit's last reply either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from mcore_refit.inference.vllm.pipeline import LoadPipeline
from mcore_refit.inference.vllm.staging import RefitStaging
from mcore_refit.inference.vllm.verification import ReferenceModel
from mcore_refit.refit import RefitPlan, Region


class VllmModelLoader:
    """Loads refits into a vLLM model through the layerwise reload; reads them back by name.

    ``plan_of`` returns the receiver's current plan (known once the trainer sent it): the staging
    is allocated for it at the first refit and again only when the plan changes.
    ``reference`` builds the model that :meth:`check_loaded` compares with (verification only).
    Tensors go into vLLM on a background thread, in arrival order; the refit's last buffer waits
    for them (at most ``timeout_s`` of :meth:`begin`) and finishes the reload. Call :meth:`close`.
    """

    def __init__(self, *, model: torch.nn.Module, model_config, device: torch.device,
                 plan_of: Callable[[], RefitPlan | None],
                 reference: Callable[[], ReferenceModel]) -> None:
        self._model = model
        self._model_config = model_config
        self._device = torch.device(device)
        self._plan_of = plan_of
        self._make_reference = reference
        self._reference: ReferenceModel | None = None
        # The last refit's tensors, copied or referred to (see staging.py).
        self._staging: RefitStaging | None = None
        self._reloading = False
        self._timeout_s = 0.0
        self._pipeline = LoadPipeline(model.load_weights, device=self._device)
        # This refit's seconds inside vLLM's loader (the reload's set-up, its layer processing
        # and finalisation included), those of the set-up and of the finalisation alone, and
        # those the last buffer waited for loads still running when it arrived.
        self._load_s = 0.0
        self._setup_s = 0.0
        self._finalize_s = 0.0
        self._wait_s = 0.0

    def figures(self) -> dict[str, float]:
        """The last refit's figures inside vLLM: seconds in its loader (set-up, loads and
        finalisation), of the reload's set-up and of its finalisation, calls into its
        ``load_weights``, seconds the last buffer waited, and the CPU seconds of the loading
        thread (set-up and loads: less than their wall time when the thread waited for the
        GIL, a core or the device)."""
        return {"load_s": round(self._load_s, 6), "setup_s": round(self._setup_s, 6),
                "finalize_s": round(self._finalize_s, 6),
                "load_calls": self._pipeline.load_calls, "wait_s": round(self._wait_s, 6),
                "load_cpu_s": round(self._pipeline.load_cpu_s, 6)}

    @property
    def staging_bytes(self) -> int:
        return self._staging.nbytes if self._staging is not None else 0

    def begin(self, *, timeout_s: float) -> None:
        """Start a refit: vLLM's layerwise reload takes over the model's weight loaders.
        ``timeout_s`` bounds the wait, after the last buffer, for vLLM's loads still running.

        The reload is set up on the loading thread, ahead of the refit's loads: this returns at
        once, and the set-up overlaps the transport's start and first buffer (a failure is
        raised like a load's). :meth:`wait_until_set_up` waits for it."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._reloading:
            raise RuntimeError("a refit into this vLLM model is already open")
        if self._pipeline.busy:
            raise RuntimeError("vLLM's loader is still running the loads of a refit that timed "
                               "out; the model cannot take another refit")
        self._reloading = True
        self._timeout_s = timeout_s
        self._pipeline.reset_timing()
        self._load_s = self._setup_s = self._finalize_s = self._wait_s = 0.0
        if self._staging is not None:
            self._staging.begin()
        model = self._model

        def set_up() -> None:
            started = time.perf_counter()
            initialize_layerwise_reload(model)
            self._setup_s = time.perf_counter() - started

        self._pipeline.run(set_up, what="setting up vLLM's layerwise reload")

    def wait_until_set_up(self) -> None:
        """Wait (at most ``timeout_s`` of :meth:`begin`) until :meth:`begin`'s set-up of the
        reload has run; raises its failure."""
        self._pipeline.drain(timeout_s=self._timeout_s)

    def end(self) -> None:
        """Wait for vLLM's loads of this refit, then finish the layerwise reload (layers not
        completed while loading are processed now: padded ones, attention; after a failed
        refit, untouched layers get their old weights back). Raises what a load raised, after
        finishing. Idempotent."""
        self._finish(raise_failure=True)

    def abandon(self) -> None:
        """:meth:`end` for a refit that already failed: its loads' own failures are dropped."""
        self._finish(raise_failure=False)

    def load_from_memory(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``weights`` (whole HF tensors already in memory, e.g. :meth:`staged_weights`)
        in one call and finish the reload, on the thread a refit's loads run on: vLLM's own
        load of a refit's tensors, without the transport (the benchmark's floor). Call
        :meth:`begin` first (and :meth:`wait_until_set_up` to leave the set-up out)."""
        if not self._reloading:
            raise RuntimeError("call begin() before load_from_memory()")
        self._pipeline.submit(weights)
        self.end()

    def close(self) -> None:
        """Stop the loading thread and let go of the last refit's tensors: those referred to
        are the trainer's memory or the transport's slots, which the trainer counts as still
        mapped (CUDA IPC) until every view of them here is gone. Idempotent."""
        self._pipeline.close()
        if self._staging is not None:
            self._staging.release()

    # --- WeightLoader ----------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._feed(self._staged().put(weights))

    def load_weight_pieces(self, pieces: Iterable[tuple[str, torch.Tensor, Region]]) -> None:
        self._feed(self._staged().put_pieces(pieces))

    def load_weights_held(self, weights: Iterable[tuple[str, torch.Tensor]],
                          pieces: Iterable[tuple[str, torch.Tensor, Region]]) -> None:
        """Load one buffer whose tensors stay valid and unchanged until the refit ends (its
        slot is not refilled before: the plan gives every buffer a slot of its own): whole
        tensors go to vLLM uncopied, pieces are assembled in a staging held for them alone."""
        plan = self._refit_plan()
        staging = self._staging_for(plan, plan.piecewise_names)
        self._feed(staging.refer(weights) + staging.put_pieces(pieces))

    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]],
                              pieces: Iterable[tuple[str, torch.Tensor, Region]]) -> None:
        """Load a whole refit whose tensors stay valid and unchanged until this returns (the
        trainer's own memory, shared): whole tensors go to vLLM as they are, with no copy, and
        vLLM starts on them while tensors in pieces are assembled in a staging held for them
        alone. vLLM's loads and the reload are finished when this returns: nothing keeps a view
        of the tensors afterwards but this loader, for :meth:`get_weight` (until the next
        refit, or :meth:`close`)."""
        plan = self._refit_plan()
        weights, pieces = list(weights), list(pieces)
        piecewise = frozenset(name for name, _, _ in pieces)
        arrived = {name for name, _ in weights}
        missing = [name for name in plan.names if name not in arrived and name not in piecewise]
        repeated = len(weights) - len(arrived) + len(piecewise & arrived)
        if missing or repeated:
            raise ValueError(f"a refit loaded in place must bring every planned tensor once: "
                             f"{len(missing)} missing ({missing[:5]}), {repeated} repeated")
        staging = self._staging_for(plan, piecewise)
        try:
            self._submit(staging.refer(weights))
            assembled = staging.put_pieces(pieces)
            if not staging.complete:
                whole = dict(assembled)
                partial = [name for name in piecewise if name not in whole]
                raise ValueError(f"the pieces of {len(partial)} tensors do not cover them: "
                                 f"{partial[:5]}")
            self._submit(assembled)
        except BaseException:
            self.abandon()  # vLLM stops reading the tensors before the caller replies
            raise
        self.end()

    def get_weight(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as it arrived in the last refit (the trainer's digests are
        compared with it); vLLM's parameters are checked by :meth:`check_loaded`. A tensor
        loaded uncopied is the memory it was loaded from (valid while that refit's is)."""
        if self._staging is None:
            raise ValueError(f"no refit has reached this vLLM model yet (asked for {name!r})")
        return self._staging.tensor(name)

    def staged_weights(self, *, copy_referred: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the plan as it arrived in the last refit (empty before the first;
        those loaded uncopied: the memory they were loaded from, the trainer's or the
        transport's, which changes at the next refit and goes when the transport closes;
        ``copy_referred``: copies of those, which outlive both)."""
        staging = self._staging
        if staging is None:
            return []
        return [(name, staging.tensor(name).clone() if copy_referred and staging.referred(name)
                 else staging.tensor(name)) for name in staging.names]

    def check_loaded(self) -> str | None:
        """Compare every vLLM parameter with what vLLM's plain loader makes of the tensors of
        the last refit (in a reference copy of the model), bitwise; ``None`` when all equal,
        else a message naming the parameters that differ."""
        weights = self.staged_weights()
        if not weights or self._reloading:
            return "cannot check vLLM's parameters: no finished refit"
        if self._reference is None:
            self._reference = self._make_reference()
        return self._reference.compare(self._model, weights)

    # --- internals -------------------------------------------------------------------------

    def _refit_plan(self) -> RefitPlan:
        """The plan of the refit that weights arrive in (raises outside one)."""
        if not self._reloading:
            raise RuntimeError("weights arrived outside a refit (call begin() first)")
        plan = self._plan_of()
        if plan is None:
            raise RuntimeError("weights arrived before the receiver has a plan")
        return plan

    def _staged(self) -> RefitStaging:
        return self._staging_for(self._refit_plan(), None)

    def _staging_for(self, plan: RefitPlan, copied: frozenset[str] | None) -> RefitStaging:
        """The staging of ``plan`` that copies the tensors ``copied`` (``None``: all), begun for
        this refit: the one held (allocated at the first refit), or a new one for another plan
        or another way of loading it."""
        staging = self._staging
        if (staging is None or staging.fingerprint != plan.fingerprint
                or staging.copied != copied):
            self._staging = None  # release the old staging's memory before allocating
            self._staging = staging = RefitStaging(plan, self._device, copied=copied)
            staging.begin()
        return staging

    def _feed(self, whole: list[tuple[str, torch.Tensor]]) -> None:
        """Staged tensors to vLLM (on the pipeline's thread); the slot they came from is free
        once this returns: vLLM reads only the staging, which is not rewritten before the next
        refit's :meth:`begin`."""
        self._submit(whole)
        if self._staging.complete:
            # Every tensor arrived: finish now, so the engine computes with the new weights
            # (and a verification reads them) when the trainer's refit returns.
            self.end()

    def _submit(self, whole: list[tuple[str, torch.Tensor]]) -> None:
        if whole:
            self._pipeline.submit(whole)

    def _finish(self, *, raise_failure: bool) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._reloading:
            return
        self._reloading = False
        started = time.perf_counter()
        failure = None
        try:
            self._pipeline.drain(timeout_s=self._timeout_s)
        except TimeoutError:
            raise  # a load still runs on the model: finalising now would race it
        except Exception as error:
            failure = error
        self._wait_s = time.perf_counter() - started
        finalized = time.perf_counter()
        finalize_layerwise_reload(self._model, self._model_config)
        self._finalize_s = time.perf_counter() - finalized
        self._load_s = self._pipeline.load_s + self._finalize_s
        if failure is not None and raise_failure:
            raise failure
