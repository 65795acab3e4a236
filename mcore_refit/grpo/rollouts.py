"""Rollout generation and refits for the GRPO loop, colocated or on dedicated inference ranks.

Both backends implement :class:`~mcore_refit.grpo.protocol.Rollouts` — :meth:`generate`,
:meth:`release` (before training), :meth:`refit` (after the optimizer step) and :meth:`close` —
and both are collectives over the trainer ranks: every trainer rank calls them in the same order
and gets the same completions, or the same error naming the rank where it started.

- :class:`ColocatedRollouts`: every trainer rank spawns an engine process on its own device and
  refits it over ZMQ + CUDA IPC (shared memory on CPU); prompts are split over trainer ranks;
- :class:`NonColocatedRollouts`: trainer rank 0 drives the inference ranks of a
  :class:`~mcore_refit.non_colocated.NonColocatedJob` with JSON commands, and every trainer rank
  sends the buffers it exports to them; :func:`serve_inference` is the inference ranks' side.

Every wait for a peer is on the host, over the control plane (:mod:`mcore_refit.control`,
gloo), never inside an NCCL collective: a waiting kernel would time-slice with the engine that
shares the GPU. The bounds, all from the config:

- an engine's generation (and any other engine command) and the inference ranks' generate
  replies: ``inference.timeout_s``;
- the inference ranks' update_weights replies after a refit: ``refit.transport.timeout_s`` (the
  refit's own waits: ``refit.transport.start_timeout_s`` and ``refit.transport.timeout_s``);
- the trainer ranks' waits for each other's outcomes, and the inference ranks' wait for trainer
  rank 0's next command: the job's ``collective_timeout_s``, longer than all of the above, so the
  rank that knows what went wrong reports it before its peers give up.

Completions travel between processes and ranks as JSON (``completions_to_json``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mcore_refit.control import ControlError, ControlGroup, Outcome, RankFailure
from mcore_refit.distributed import DistributedContext
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.seeds import derive_seed
from mcore_refit.inference.engine import Completion, SamplingConfig
from mcore_refit.inference.process import (
    EngineProcess,
    EngineSpec,
    completions_from_json,
    completions_to_json,
    open_engine,
    receive_weight_update,
)
from mcore_refit.non_colocated import NonColocatedJob
from mcore_refit.refit import (
    NonColocatedInitInfo,
    RefitError,
    RefitPlan,
    RefitSource,
    RefitTelemetry,
    Refitter,
    create_sender,
    plan_for_source,
    transport_for,
)


class ColocatedRollouts:
    """One engine process per trainer rank, on that rank's device."""

    def __init__(self, *, config: GRPOJobConfig, context: DistributedContext,
                 source: RefitSource, job_id: str) -> None:
        self._config = config
        self._context = context
        self._trainers = ControlGroup(context.control_group,
                                      timeout_s=config.collective_timeout_s,
                                      name="the trainer ranks' control group",
                                      peers=context.peers)
        self._released = False
        self.engine: EngineProcess | None = None
        self.refitter: Refitter | None = None
        # Collective over the trainer ranks. A failure on one rank (an engine that does not
        # start, a device already taken by another trainer) is raised on all of them before any
        # rank enters the export.
        try:
            self._trainers.run_everywhere("starting the inference engine", self._start_engine,
                                          who="trainer rank")
            plan = plan_for_source(source, config=config.refit.plan, device=context.device)
            self._trainers.run_everywhere("connecting the inference engine", self._connect,
                                          source=source, plan=plan, job_id=job_id,
                                          who="trainer rank")
        except BaseException:
            self.close()
            raise

    def _start_engine(self) -> None:
        config, context = self._config, self._context
        self.engine = EngineProcess(
            engine_spec(config, device=context.device, seed=config.run.seed + context.rank),
            timeout_s=config.inference.timeout_s, liveness_s=config.refit.transport.liveness_s,
        )

    def _connect(self, *, source: RefitSource, plan: RefitPlan, job_id: str) -> None:
        context = self._context
        # A GPU names its socket by its UUID; on CPU every rank shares the "device", so the
        # socket needs a per-rank identity.
        cpu_device_id = f"{job_id}-rank{context.rank}" if context.device.type == "cpu" else None
        several = context.world_size > 1
        options = self._config.refit.transport
        sender = create_sender(transport_for("colocated", options), plan=plan,
                               device=context.device, options=options,
                               cpu_device_id=cpu_device_id,
                               trainers=dist.group.WORLD if several else None,
                               control=self._trainers if several else None, rank=context.rank,
                               peer_alive=self.engine.alive_problem)
        self.refitter = Refitter(source=source, sender=sender)
        # The engine connects while the trainer prepares: send first, collect the reply after.
        self.engine.submit("init_weight_transfer_engine",
                           init_info={"transport": sender.transport_name,
                                      "address": sender.address})
        self.refitter.prepare()
        self.engine.wait("init_weight_transfer_engine")

    def generate(self, prompts: Sequence[str], *, num_samples: int, sampling: SamplingConfig,
                 seed: int) -> list[list[Completion]]:
        """Completions for every prompt on every trainer rank; each rank samples its share.

        Rank r's engine samples with ``derive_seed(seed, r)``. Each engine has
        ``inference.timeout_s``; the ranks then exchange their shards (or errors) over the
        trainer ranks' gloo group.
        """
        rank, world = self._context.rank, self._context.world_size
        local = Outcome.of(self.engine.call, "generate", prompts=list(prompts[rank::world]),
                           num_samples=num_samples, sampling=sampling,
                           seed=derive_seed(seed, rank))
        shards = self._trainers.share_outcomes(local, what="generate", who="trainer rank")
        return interleave([completions_from_json(shard) for shard in shards], len(prompts))

    def release(self) -> None:
        """Free the engines' weights and KV cache while the trainer trains (if configured)."""
        if self._config.inference.release_memory:
            self._trainers.run_everywhere("release_memory", self.engine.call, "release_memory",
                                          who="trainer rank")
            self._released = True

    def refit(self, *, weight_version: int, verify: bool) -> RefitTelemetry:
        """Push the trainer's current weights into every rank's engine.

        Every rank takes part in the whole refit (its export and the buffers it passes on), also
        when its own engine failed; the failure is raised on every rank afterwards. The transfer
        is bounded by ``refit.transport``'s timeouts, the engine's reply by
        ``inference.timeout_s``.
        """
        engine_problem = Outcome.of(self._prepare_engine, weight_version)
        telemetry = Outcome.of(self.refitter.refit, verify=verify)
        reply = Outcome.of(self.engine.wait, "update_weights") if engine_problem.ok else None
        # Only failures travel; the telemetry stays on its rank.
        outcome = next((o for o in (engine_problem, telemetry, reply)
                        if o is not None and not o.ok), Outcome(ok=True))
        self._trainers.share_outcomes(outcome, what="refit", who="trainer rank")
        return telemetry.value

    def _prepare_engine(self, weight_version: int) -> None:
        if self._released:
            self.engine.call("reacquire_memory")
            self._released = False
        self.engine.submit("update_weights", weight_version=weight_version)

    def close(self, *, failed: bool = False) -> None:
        try:
            if self.refitter is not None:
                self.refitter.close()
        finally:
            if self.engine is not None:
                self.engine.close()


class NonColocatedRollouts:
    """Trainer side of a non-colocated job: trainer rank 0 drives the inference ranks, and every
    trainer rank sends the refit buffers it exports."""

    def __init__(self, *, config: GRPOJobConfig, job: NonColocatedJob, source: RefitSource) -> None:
        self._job = job
        self._config = config
        self._lead = job.context.rank == 0
        timeout_s, peers = config.collective_timeout_s, job.context.peers
        self._trainers = ControlGroup(job.context.control_group, timeout_s=timeout_s,
                                      name="the trainer ranks' control group",
                                      peers=_among(peers, range(job.num_trainer_ranks)))
        self._commands = (ControlGroup(job.control_group, timeout_s=timeout_s,
                                       name="the inference command group",
                                       peers=_among(peers, _command_ranks(job)))
                          if self._lead else None)
        # Planning reads every trainer rank's export layout: a collective over them.
        plan = plan_for_source(source, config=config.refit.plan, device=job.context.device)
        # An inference engine that failed to start is named on every trainer rank, with its
        # cause, before the refit's set-up (which would otherwise only see the rank gone).
        self._share_lead_outcome(Outcome.of(self._start_inference_ranks) if self._lead
                                 else Outcome(ok=True), "start of the inference engines")
        sender = create_sender(
            transport_for("non_colocated", config.refit.transport),
            plan=plan, placement=job.placement, rank=job.context.rank,
            control=ControlGroup(job.refit_control, timeout_s=timeout_s,
                                 name="the refit control group", peers=peers),
            data_group=job.data_groups.get(job.context.rank), links=job.links,
            device=job.context.device, options=config.refit.transport,
            cpu_device_id=f"job{job.global_rank}")
        self.refitter = Refitter(source=source, sender=sender)
        self.refitter.prepare()

    def generate(self, prompts: Sequence[str], *, num_samples: int, sampling: SamplingConfig,
                 seed: int) -> list[list[Completion]]:
        """Completions for every prompt on every trainer rank.

        Trainer rank 0 sends the prompts to the inference ranks (each samples its share, inference
        rank r with ``derive_seed(seed, r)``) and
        waits ``inference.timeout_s`` for their replies; then it shares its outcome with the
        other trainer ranks over their gloo group.
        """
        outcome = Outcome(ok=True)
        if self._lead:
            outcome = Outcome.of(self._generate_on_inference_ranks, prompts=prompts,
                                 num_samples=num_samples, sampling=sampling, seed=seed)
        shards = self._share_lead_outcome(outcome, "generate")
        return interleave([completions_from_json(shard) for shard in shards], len(prompts))

    def _generate_on_inference_ranks(self, *, prompts: Sequence[str], num_samples: int,
                                      sampling: SamplingConfig, seed: int) -> list:
        self._command({"op": "generate", "prompts": list(prompts), "num_samples": num_samples,
                       "sampling": sampling.to_json(), "seed": seed})
        return self._replies("generate", timeout_s=self._config.inference.timeout_s)

    def release(self) -> None:
        """Nothing to release: the engines have devices of their own."""

    def refit(self, *, weight_version: int, verify: bool) -> RefitTelemetry:
        """Every trainer rank sends the buffers it exports; a failure on any rank of the job is
        raised on every trainer rank.

        The transfer is bounded by ``refit.transport``'s timeouts; trainer rank 0 then waits
        ``refit.transport.timeout_s`` for the inference ranks' replies and shares them with the
        other trainer ranks.
        """
        if self._lead:
            self._command({"op": "update", "weight_version": weight_version})
        try:
            telemetry = self.refitter.refit(verify=verify)
        except RefitError:
            # Every rank of the job raises this same error (the refit's outcome exchange). The
            # inference ranks reply all the same: collecting the replies keeps the command group
            # in step.
            if self._lead:
                Outcome.of(self._replies, "update_weights", timeout_s=self._reply_timeout_s)
            raise
        replies = Outcome(ok=True)
        if self._lead:
            replies = Outcome.of(self._replies, "update_weights", timeout_s=self._reply_timeout_s)
        self._trainers.share_outcomes(replies, what="refit", who="trainer rank")
        return telemetry

    @property
    def _reply_timeout_s(self) -> float:
        return self._config.refit.transport.timeout_s

    def close(self, *, failed: bool = False) -> None:
        """Stop the inference ranks and close the refitter. After a failure (``failed``) the
        stop command is best effort: an inference rank that already left cannot take it, and
        that must not hide the failure being raised."""
        try:
            if self._lead:
                with contextlib.suppress(*((ControlError,) if failed else ())):
                    self._command({"op": "stop"})
        finally:
            self.refitter.close()

    def _start_inference_ranks(self) -> None:
        self._command({"op": "init"})
        self._replies("the engine's start", timeout_s=self._config.collective_timeout_s)

    def _command(self, command: dict) -> None:
        self._commands.broadcast_json(command, src=0, what=f"the {command['op']} command")

    def _replies(self, what: str, *, timeout_s: float) -> list:
        """Every inference rank's reply to the last command (raises naming a failed one)."""
        rows = self._commands.all_gather_json(None, what=f"the inference ranks' {what}",
                                              timeout_s=timeout_s)
        values = []
        for index, row in enumerate(rows[1:]):
            reply = Outcome.from_json(row)
            if not reply.ok:
                raise RuntimeError(f"inference rank {index} failed {what}: {reply.error}")
            values.append(reply.value)
        return values

    def _share_lead_outcome(self, outcome: Outcome, what: str) -> Any:
        """Trainer rank 0's value on every trainer rank, or :class:`RankFailure` naming trainer
        rank 0 with its error on every one (``outcome`` is ignored on the other ranks)."""
        shared = Outcome.from_json(self._trainers.broadcast_json(
            outcome.to_json() if self._lead else None, src=0, what=f"trainer rank 0's {what}"))
        if not shared.ok:
            raise RankFailure(what, [(0, shared)], who="trainer rank")
        return shared.value


def serve_inference(*, config: GRPOJobConfig, job: NonColocatedJob) -> None:
    """The inference ranks' loop: answer trainer rank 0's commands until it says stop.

    The engine starts first; its outcome is the reply to the first command (``init``), so an
    engine that failed to start is reported to the trainers, then raised here.
    """
    device = job.context.device
    timeout_s, peers = config.collective_timeout_s, job.context.peers
    commands = ControlGroup(job.control_group, timeout_s=timeout_s,
                            name="the inference command group",
                            peers=_among(peers, _command_ranks(job)))
    spec = engine_spec(config, device=device, seed=config.run.seed + 1000 + job.context.rank)
    try:
        engine, endpoint = open_engine(spec, device=device)
    except Exception as error:
        _report_start_failure(commands, error)
        raise
    shard, num_shards = job.context.rank, job.num_inference_ranks
    with endpoint:
        while True:
            command = commands.broadcast_json(None, src=0, what="trainer rank 0's next command")
            op = command["op"]
            if op == "stop":
                return
            if op == "init":
                commands.all_gather_json(Outcome(ok=True).to_json(),
                                         what="the engine start replies")
                endpoint.init_weight_transfer_engine(NonColocatedInitInfo(
                    placement=job.placement, receiver=job.context.rank,
                    control=ControlGroup(job.refit_control, timeout_s=timeout_s,
                                         name="the refit control group", peers=peers),
                    data_groups=job.data_groups, links=job.links))
            elif op == "generate":
                reply = Outcome.of(_generate_shard, engine, command, shard, num_shards)
                commands.all_gather_json(reply.to_json(), what="the generate replies")
            elif op == "update":
                reply = Outcome.of(receive_weight_update, endpoint, engine,
                                   command["weight_version"])
                commands.all_gather_json(reply.to_json(), what="the update_weights replies")
            else:
                raise ValueError(f"unknown control command {op!r} from trainer rank 0")


def _report_start_failure(commands: ControlGroup, error: Exception) -> None:
    """Answer trainer rank 0's first command (``init``; ``stop`` when the trainers failed
    first) with the engine's start failure."""
    command = commands.broadcast_json(None, src=0, what="trainer rank 0's first command")
    if command["op"] == "init":
        commands.all_gather_json(Outcome.failed(error).to_json(),
                                 what="the engine start replies")


def engine_spec(config: GRPOJobConfig, *, device: torch.device, seed: int) -> EngineSpec:
    """The engine the config asks for (``inference.engine``, its dtype and vLLM sizing), on
    ``device``, sampling from ``seed``."""
    return EngineSpec(hf_path=config.model.hf_path, device=str(device),
                      dtype=config.inference.dtype, seed=seed, transport=config.refit.transport,
                      engine=config.inference.engine, vllm=config.inference.vllm)


def _command_ranks(job: NonColocatedJob) -> list[int]:
    """The job ranks of the inference command group: trainer rank 0 and the inference ranks."""
    return [0, *range(job.num_trainer_ranks, job.num_trainer_ranks + job.num_inference_ranks)]


def _among(peers, ranks):
    return peers.among(ranks) if peers is not None else None


def _generate_shard(engine, command: dict, shard: int,
                    num_shards: int) -> list[list[dict]]:
    groups = engine.generate(command["prompts"][shard::num_shards],
                             num_samples=command["num_samples"],
                             sampling=SamplingConfig.from_json(command["sampling"]),
                             seed=derive_seed(command["seed"], shard))
    return completions_to_json(groups)


def interleave(shards: Sequence[Sequence[Any]], num_prompts: int) -> list[Any]:
    """Undo ``prompts[rank::world]`` sharding: shard ``r`` holds prompts r, r+world, ..."""
    world = len(shards)
    return [shards[index % world][index // world] for index in range(num_prompts)]
