"""Rollout generation and refits for the GRPO loop, colocated or on dedicated inference ranks.

Both backends offer the trainer the same three calls — :meth:`generate`, :meth:`release` (before
training) and :meth:`refit` (after the optimizer step) — and both are collectives over the
trainer ranks: every trainer rank calls them in the same order and gets the same completions.

- :class:`ColocatedRollouts`: every trainer rank spawns an engine process on its own device and
  refits it over ZMQ + CUDA IPC (shared memory on CPU); prompts are split over trainer ranks.
- :class:`DedicatedRollouts`: trainer rank 0 drives the inference ranks of a
  :class:`~mcore_refit.distributed.SplitJob` over a control group (JSON messages) and refits them
  by broadcast over the refit group; :func:`serve_inference` is the inference ranks' side.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mcore_refit.distributed import DistributedContext, SplitJob
from mcore_refit.grpo_config import GRPOJobConfig
from mcore_refit.inference.engine import Completion, InferenceEngine, SamplingConfig
from mcore_refit.inference.process import EngineProcess, EngineSpec, receive_weight_update
from mcore_refit.refit import BroadcastInitInfo, Refitter, WeightTransferEndpoint
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.refitter import make_sender, plan_for_source
from mcore_refit.refit.source import WeightSource, drain


class ColocatedRollouts:
    """One engine process per trainer rank, on that rank's device."""

    def __init__(self, *, config: GRPOJobConfig, context: DistributedContext,
                 source: WeightSource, job_id: str) -> None:
        self._config = config
        self._context = context
        self._released = False
        self.engine: EngineProcess | None = None
        self.refitter: Refitter | None = None
        # Collective over the trainer ranks. A failure on one rank (an engine that does not
        # start, a device already taken by another trainer) is raised on all of them before any
        # rank enters the export, where the others would wait until the process-group timeout.
        try:
            _on_every_rank(context, "starting the inference engine", self._start_engine)
            plan = plan_for_source(source, config=config.refit, device=context.device)
            _on_every_rank(context, "connecting the inference engine", self._connect,
                           source=source, plan=plan, job_id=job_id)
        except BaseException:
            self.close()
            raise

    def _start_engine(self) -> None:
        config, context = self._config, self._context
        self.engine = EngineProcess(
            EngineSpec(hf_path=config.model.hf_path, device=str(context.device),
                       dtype=config.inference.dtype, seed=config.run.seed + context.rank,
                       refit=config.refit),
            timeout_s=config.inference.timeout_s,
        )

    def _connect(self, *, source: WeightSource, plan: RefitPlan, job_id: str) -> None:
        context = self._context
        # A GPU names its socket by its UUID; on CPU every rank shares the "device", so the
        # socket needs a per-rank identity.
        cpu_device_id = f"{job_id}-rank{context.rank}" if context.device.type == "cpu" else None
        sender = make_sender(config=self._config.refit, plan=plan, device=context.device,
                             cpu_device_id=cpu_device_id)
        self.refitter = Refitter(source=source, sender=sender)
        # The engine connects while the trainer prepares: send first, collect the reply after.
        self.engine.submit("init_weight_transfer_engine",
                           init_info={"transport": "ipc", "address": sender.address})
        self.refitter.prepare()
        self.engine.wait("init_weight_transfer_engine")

    def generate(self, prompts: Sequence[str], *, num_samples: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        """Completions for every prompt on every trainer rank; each rank samples its share."""
        rank, world = self._context.rank, self._context.world_size
        # Every rank learns whether any engine failed, so all raise instead of some waiting.
        local = _outcome(self.engine.call, "generate", prompts=list(prompts[rank::world]),
                         num_samples=num_samples, sampling=sampling)
        outcomes = _all_gather(self._context, local)
        return _interleave(_results_or_raise(outcomes, "generate", who="trainer rank"),
                           len(prompts))

    def release(self) -> None:
        """Free the engines' weights and KV cache while the trainer trains (if configured)."""
        if self._config.inference.release_memory:
            _on_every_rank(self._context, "release_memory", self.engine.call, "release_memory")
            self._released = True

    def refit(self, *, weight_version: int, verify: bool) -> dict:
        """Push the trainer's current weights into this rank's engine.

        A failure on any rank (an engine that died, a load error) is raised on every rank, once
        every rank has finished its part of the export.
        """
        return _on_every_rank(self._context, "refit", self._refit_own_engine,
                              weight_version=weight_version, verify=verify)

    def _refit_own_engine(self, *, weight_version: int, verify: bool) -> dict:
        try:
            if self._released:
                self.engine.call("reacquire_memory")
                self._released = False
            self.engine.submit("update_weights", weight_version=weight_version)
        except Exception:
            # The export is a collective over the trainer ranks: take part though nothing can
            # be sent, or the other ranks wait in it until the process-group timeout.
            drain(self.refitter.source)
            raise
        try:
            telemetry = self.refitter.refit(verify=verify)
        finally:
            self.engine.wait("update_weights")
        return telemetry.as_dict()

    def close(self) -> None:
        try:
            if self.refitter is not None:
                self.refitter.close()
        finally:
            if self.engine is not None:
                self.engine.close()


class DedicatedRollouts:
    """Trainer side of a non-colocated job: trainer rank 0 drives the inference ranks."""

    def __init__(self, *, config: GRPOJobConfig, job: SplitJob, source: WeightSource) -> None:
        self._job = job
        self._source = source
        self._config = config
        self._lead = job.context.rank == 0
        self.refitter = None
        # Planning exports once, a collective over all trainer ranks.
        plan = plan_for_source(source, config=config.refit, device=job.context.device)
        if self._lead:
            _send_command(job.control_group, {"op": "init"})
            sender = make_sender(config=config.refit, plan=plan, device=job.context.device,
                                 group=job.refit_group, src_rank=0)
            self.refitter = Refitter(source=source, sender=sender)
            self.refitter.prepare()

    def generate(self, prompts: Sequence[str], *, num_samples: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        return self._from_lead("generate", self._generate_on_inference_ranks, prompts=prompts,
                               num_samples=num_samples, sampling=sampling)

    def _generate_on_inference_ranks(self, *, prompts: Sequence[str], num_samples: int,
                                     sampling: SamplingConfig) -> list[list[Completion]]:
        _send_command(self._job.control_group, {
            "op": "generate", "prompts": list(prompts), "num_samples": num_samples,
            "sampling": dataclasses.asdict(sampling)})
        replies = _gather_json(self._job.control_group, None)[1:]
        _raise_on_error(replies, "generate")
        return _interleave([_completions_from_reply(reply) for reply in replies], len(prompts))

    def release(self) -> None:
        """Nothing to release: the engines have GPUs of their own."""

    def refit(self, *, weight_version: int, verify: bool) -> dict:
        """Trainer rank 0 broadcasts the weights to the inference ranks; the other trainer ranks
        take part in the export. A failure is raised on every trainer rank."""
        # The export is a collective over the trainer ranks: the others take part, send nothing.
        return self._from_lead("refit", self._refit_inference_ranks,
                               others=functools.partial(drain, self._source),
                               weight_version=weight_version, verify=verify)

    def _from_lead(self, what: str, action, *, others=None, **kwargs) -> Any:
        """``action(**kwargs)`` on trainer rank 0 (``others()`` on the other trainer ranks);
        every trainer rank returns rank 0's result, or raises its error."""
        outcome: list[Any] = [None]
        if self._lead:
            outcome[0] = _outcome(action, **kwargs)
        elif others is not None:
            others()
        dist.broadcast_object_list(outcome, src=0)
        return _results_or_raise(outcome, what, who="trainer rank")[0]

    def _refit_inference_ranks(self, *, weight_version: int, verify: bool) -> dict:
        _send_command(self._job.control_group, {"op": "update", "weight_version": weight_version})
        try:
            telemetry = self.refitter.refit(verify=verify)
        finally:
            # The inference ranks reply whether or not the refit went through (the broadcast's
            # finish exchange tells them); collecting the replies keeps the control group in step.
            replies = _gather_json(self._job.control_group, None)[1:]
        _raise_on_error(replies, "update_weights")
        return telemetry.as_dict()

    def close(self) -> None:
        if self._lead:
            _send_command(self._job.control_group, {"op": "stop"})
            self.refitter.close()


def serve_inference(*, config: GRPOJobConfig, job: SplitJob) -> None:
    """The inference ranks' loop: answer trainer rank 0's commands until it says stop."""
    device = job.context.device
    engine = InferenceEngine(config.model.hf_path, device=device,
                             dtype=getattr(torch, config.inference.dtype),
                             seed=config.run.seed + 1000 + job.context.rank)
    shard, num_shards = job.context.rank, job.num_inference_ranks
    with WeightTransferEndpoint(engine=engine, device=device, config=config.refit) as endpoint:
        while True:
            command = _receive_command(job.control_group)
            op = command["op"]
            if op == "stop":
                return
            if op == "init":
                endpoint.init_weight_transfer_engine(
                    BroadcastInitInfo(src_rank=0, group=job.refit_group))
            elif op == "generate":
                _gather_json(job.control_group,
                             _run_reply(_generate_shard, engine, command, shard, num_shards))
            elif op == "update":
                _gather_json(job.control_group, _run_reply(
                    receive_weight_update, endpoint, engine, command["weight_version"]))
            else:
                raise ValueError(f"unknown control command {op!r} from trainer rank 0")


def _generate_shard(engine: InferenceEngine, command: dict, shard: int,
                    num_shards: int) -> list[list[dict]]:
    groups = engine.generate(command["prompts"][shard::num_shards],
                             num_samples=command["num_samples"],
                             sampling=SamplingConfig(**command["sampling"]))
    return [[_completion_to_json(c) for c in group] for group in groups]


def _on_every_rank(context: DistributedContext, what: str, action, *args, **kwargs) -> Any:
    """``action(*args, **kwargs)`` on this rank; if it failed on any rank, raise on every rank.

    Collective over the default group. Only the failures travel; the result stays local.
    """
    status, payload = _outcome(action, *args, **kwargs)
    shared = (status, payload if status == "error" else None)
    _results_or_raise(_all_gather(context, shared), what, who="trainer rank")
    return payload


def _all_gather(context: DistributedContext, item: Any) -> list[Any]:
    items: list[Any] = [None] * context.world_size
    dist.all_gather_object(items, item)
    return items


def _outcome(action, *args, **kwargs) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", message)``: a failure as data that can be shared."""
    try:
        return "ok", action(*args, **kwargs)
    except Exception as error:
        return "error", f"{type(error).__name__}: {error}"


def _results_or_raise(outcomes: Sequence[tuple[str, Any]], what: str, *, who: str) -> list[Any]:
    failed = [f"{who} {i}: {payload}" for i, (status, payload) in enumerate(outcomes)
              if status == "error"]
    if failed:
        raise RuntimeError(f"{what} failed on " + "; ".join(failed))
    return [payload for _, payload in outcomes]


def _run_reply(action, *args) -> dict:
    try:
        return {"ok": action(*args)}
    except Exception as error:  # reported to the trainer, which raises
        return {"error": f"{type(error).__name__}: {error}"}


def _raise_on_error(replies: list[dict], what: str) -> None:
    for index, reply in enumerate(replies):
        if "error" in reply:
            raise RuntimeError(f"inference rank {index} failed {what}: {reply['error']}")


def _completions_from_reply(reply: dict) -> list[list[Completion]]:
    _raise_on_error([reply], "generate")
    return [[Completion(prompt_ids=tuple(c["prompt_ids"]), token_ids=tuple(c["token_ids"]),
                        logprobs=tuple(c["logprobs"]), text=c["text"], stopped=c["stopped"])
             for c in group] for group in reply["ok"]]


def _completion_to_json(completion: Completion) -> dict:
    return {"prompt_ids": list(completion.prompt_ids), "token_ids": list(completion.token_ids),
            "logprobs": list(completion.logprobs), "text": completion.text,
            "stopped": completion.stopped}


def _interleave(shards: Sequence[Sequence[Any]], num_prompts: int) -> list[Any]:
    """Undo ``prompts[rank::world]`` sharding: shard ``r`` holds prompts r, r+world, ..."""
    world = len(shards)
    ordered = [shards[index % world][index // world] for index in range(num_prompts)]
    return ordered


# --- JSON messages over a standalone gloo group (trainer rank 0 is rank 0 of the group) -------


def _send_command(group: dist.ProcessGroup, command: dict) -> None:
    _broadcast_bytes(group, json.dumps(command).encode())


def _receive_command(group: dist.ProcessGroup) -> dict:
    return json.loads(_broadcast_bytes(group, None).decode())


def _broadcast_bytes(group: dist.ProcessGroup, payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank of ``group`` (length first, then the bytes)."""
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    group.broadcast(length, 0).wait()
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
            else torch.empty(int(length.item()), dtype=torch.uint8))
    if data.numel():
        group.broadcast(data, 0).wait()
    return data.numpy().tobytes()


def _gather_json(group: dist.ProcessGroup, value: Any) -> list[Any]:
    """Every rank's JSON ``value``, in group-rank order, on every rank of ``group``."""
    payload = json.dumps(value).encode()
    size = group.size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    group.allgather([lengths], [torch.tensor([len(payload)], dtype=torch.int64)]).wait()
    width = max(int(t.item()) for t in lengths)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.zeros(width, dtype=torch.uint8) for _ in range(size)]
    group.allgather([gathered], [padded]).wait()
    return [json.loads(t[:int(n.item())].numpy().tobytes().decode())
            for t, n in zip(gathered, lengths, strict=True)]
