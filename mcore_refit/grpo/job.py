"""Running a GRPO job: process groups, the trainer, the rollouts backend, the loop.

:func:`run_colocated` and :func:`run_non_colocated` are what ``recipes/grpo.py`` calls with
torchrun's ranks; both return the summary on every trainer rank (None on inference ranks) and
tear the process groups down however the run ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from mcore_refit import distributed
from mcore_refit.config import ConfigError
from mcore_refit.control import ControlGroup, raise_dead_peer_first
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.evaluation import EVAL_SEED_OFFSET, draw_eval_set
from mcore_refit.grpo.loop import check_same_optimizer, run_grpo
from mcore_refit.grpo.memory import check_grpo_memory
from mcore_refit.grpo.preflight import check_model_and_data
from mcore_refit.grpo.protocol import Rollouts
from mcore_refit.grpo.rollouts import ColocatedRollouts, NonColocatedRollouts, serve_inference
from mcore_refit.grpo.rundir import RunDirectory
from mcore_refit.inference.engine import pad_token_id
from mcore_refit.interrupts import StopSignals
from mcore_refit.memory import gpu_capacities
from mcore_refit.non_colocated import init_non_colocated_job
from mcore_refit.policy.worker import Policy, build_policy
from mcore_refit.processes import PeerWatch
from mcore_refit.refit import SharedMemoryParameters


def validate_launch(config: GRPOJobConfig, *, world_size: int, resume: bool,
                    local_world_size: int | None = None, num_gpus: int | None = None,
                    capacity_of: Callable[[int], int] | None = None) -> None:
    """What the config alone cannot check: the launch's size, local files (the model's, the
    data against the model: :mod:`~mcore_refit.grpo.preflight`), each GPU's memory, the run
    directory.

    Cheap and local: call on every rank before the start-up (process groups, model), so a bad
    launch fails in seconds with an error that names the key, or the GPU that is short
    (:class:`~mcore_refit.memory.InsufficientGpuMemory`). The GPUs (``num_gpus`` per node of
    ``local_world_size`` ranks, ``capacity_of(gpu)`` bytes each) default to this node's; without
    CUDA nothing is checked.
    """
    try:
        config.model.check_local()
    except ConfigError as error:
        raise error.at("model") from None
    num_trainers, num_engines = _roles(config, world_size)
    parallel = config.parallel
    if num_trainers % parallel.model_parallel_size != 0:
        layout = (f"`parallel.tensor` × `parallel.pipeline` = {parallel.tensor} × "
                  f"{parallel.pipeline}")
        if config.refit.mode == "colocated":
            raise ConfigError(f"{world_size} launched ranks do not divide into {layout}; launch "
                              f"a multiple of {parallel.model_parallel_size} ranks")
        fitting = -(-num_trainers // parallel.model_parallel_size) * parallel.model_parallel_size
        raise ConfigError(
            f"{world_size} launched ranks less `inference.num_ranks`={num_engines} leave "
            f"{num_trainers} trainer rank(s), which do not divide into {layout}; launch "
            f"{fitting + num_engines} ranks ({fitting} trainer + {num_engines} inference)")
    if config.grpo.prompts_per_step < num_engines:
        raise ConfigError(
            f"`grpo.prompts_per_step`={config.grpo.prompts_per_step} is smaller than the "
            f"{num_engines} inference engines ({_engines_come_from(config)}); every engine "
            "needs at least one prompt per step")
    if num_gpus is None and torch.cuda.is_available():
        num_gpus, capacity_of = torch.cuda.device_count(), gpu_capacities()
    if num_gpus is not None:
        check_grpo_memory(config, world_size=world_size,
                          local_world_size=local_world_size or world_size, num_gpus=num_gpus,
                          capacity_of=capacity_of)
    try:
        config.task.build(seed=config.run.seed, hf_path=config.model.hf_path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"`task`: {error}") from None
    if config.eval is not None:
        try:
            draw_eval_set(config.eval, seed=config.run.seed + EVAL_SEED_OFFSET,
                          hf_path=config.model.hf_path)
        except ConfigError as error:
            raise error.at("eval") from None
        except (OSError, ValueError) as error:
            raise ConfigError(f"`eval`: {error}") from None
    check_model_and_data(config)
    run_dir = RunDirectory(config.run.output_dir)
    state = run_dir.claim(resume=resume, steps=config.run.steps)
    if state is not None:
        check_same_optimizer(state, config, run_dir=run_dir)


def _roles(config: GRPOJobConfig, world_size: int) -> tuple[int, int]:
    """(trainer ranks, inference engines) of a launch of ``world_size`` ranks."""
    if config.refit.mode == "colocated":
        return world_size, world_size
    num_engines = config.inference.num_ranks
    if num_engines >= world_size:
        raise ConfigError(
            f"`inference.num_ranks`={num_engines} leaves no trainer rank among the {world_size} "
            f"launched ranks (`refit.mode`=non_colocated); launch at least {num_engines + 1}")
    return world_size - num_engines, num_engines


def _engines_come_from(config: GRPOJobConfig) -> str:
    if config.refit.mode == "colocated":
        return "one per launched rank, `refit.mode`=colocated"
    return "`inference.num_ranks`"


def run_colocated(config: GRPOJobConfig, *, rank: int, world_size: int, local_rank: int,
                  local_world_size: int, job_id: str, resume: bool,
                  stops: StopSignals | None = None) -> dict:
    """Every rank trains and refits an engine process on its own device. ``stops``: this
    process's stop signals, told the job's processes once they are known."""
    context = distributed.init_distributed(rank=rank, world_size=world_size,
                                           local_rank=local_rank,
                                           local_world_size=local_world_size,
                                           timeout_s=config.collective_timeout_s,
                                           liveness_s=config.refit.transport.liveness_s)
    if stops is not None:
        stops.watch(context.peers)
    failed = True
    try:
        policy, pad_token_id = build_trainer(config, context.device)
        with weights_readable_by_the_engine(config, policy, context.device):
            trainers = trainer_control(context.control_group, config, peers=context.peers)
            source = policy.weight_source(control=trainers)
            rollouts = ColocatedRollouts(config=config, context=context, source=source,
                                         job_id=job_id)
            summary = train_and_close(config, policy, rollouts, pad_token_id, context.device,
                                      trainers, resume, stops=stops)
        failed = False
        return summary
    except BaseException as error:
        with unwinding(stops):
            raise_dead_peer_first(context.peers, error)
        raise
    finally:
        with unwinding(stops if failed else None):
            distributed.shutdown(failed=failed)


def run_non_colocated(config: GRPOJobConfig, *, rank: int, world_size: int, local_rank: int,
                      local_world_size: int, resume: bool, store_host: str,
                      store_port: int, stops: StopSignals | None = None) -> dict | None:
    """The last ``inference.num_ranks`` ranks serve inference; the others train and refit them
    (``stops`` as in :func:`run_colocated`)."""
    job = init_non_colocated_job(rank=rank, world_size=world_size, local_rank=local_rank,
                                 local_world_size=local_world_size,
                                 num_inference_ranks=config.inference.num_ranks,
                                 store_host=store_host, store_port=store_port,
                                 timeout_s=config.collective_timeout_s,
                                 liveness_s=config.refit.transport.liveness_s,
                                 fanout=config.refit.transport.fanout)
    if stops is not None:
        stops.watch(job.context.peers)
    failed = True
    try:
        if not job.is_trainer:
            serve_inference(config=config, job=job)
            failed = False
            return None
        policy, pad_token_id = build_trainer(config, job.context.device)
        # A trainer rank on an inference rank's device hands its buffers over without a link.
        prefer = {trainer for trainer, _ in job.placement.shared}
        peers = job.context.peers
        trainers = trainer_control(
            job.context.control_group, config,
            peers=peers.among(range(job.num_trainer_ranks)) if peers else None)
        source = policy.weight_source(control=trainers, prefer=prefer)
        rollouts = NonColocatedRollouts(config=config, job=job, source=source)
        summary = train_and_close(config, policy, rollouts, pad_token_id, job.context.device,
                                  trainers, resume, stops=stops)
        failed = False
        return summary
    except BaseException as error:
        with unwinding(stops):
            raise_dead_peer_first(job.context.peers, error)
        raise
    finally:
        with unwinding(stops if failed else None):
            distributed.shutdown(failed=failed)


def build_trainer(config: GRPOJobConfig, device: torch.device) -> tuple[Policy, int]:
    """Megatron's groups, the policy and the tokenizer's pad token, EOS when it has none
    (every trainer rank)."""
    from transformers import AutoTokenizer

    model_parallel = distributed.init_model_parallel(config.parallel, seed=config.run.seed)
    policy = build_policy(config.model, model_parallel, config.policy, device=device)
    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_path)
    return policy, pad_token_id(tokenizer, where=config.model.hf_path)


@contextlib.contextmanager
def weights_readable_by_the_engine(config: GRPOJobConfig, policy: Policy,
                                   device: torch.device) -> Iterator[None]:
    """With ``refit.transport.ipc_sharing``=weights on CPU, the policy's parameters in a
    shared-memory file for the block, so that the engine process can map them (CUDA memory is
    shared as it is; a CPU parameter built the usual way lives in private memory). They keep
    their identity, so the optimizer updates them there."""
    if config.refit.transport.ipc_sharing != "weights" or device.type != "cpu":
        yield
        return
    if config.policy.optimizer.use_distributed_optimizer:
        # Its parameters are views of the optimizer's buffer, which a move would cut them from.
        raise ConfigError("`refit.transport.ipc_sharing`=weights on CPU moves the parameters "
                          "into shared memory, which `policy.optimizer.use_distributed_optimizer`"
                          "=true does not allow (its parameters are views of its buffer); use "
                          "ipc_sharing=buffers")
    shared = SharedMemoryParameters(policy.model.chunks, ipc_dir=config.refit.transport.ipc_dir)
    try:
        yield
    finally:
        shared.close()


def trainer_control(group: dist.ProcessGroup, config: GRPOJobConfig, *,
                    peers: PeerWatch | None = None) -> ControlGroup:
    """The trainer ranks' host group (``group``: gloo, over the trainer ranks), which the refit's
    export and the checkpoint saves wait on; with ``peers``, a dead trainer rank is named."""
    return ControlGroup(group, timeout_s=config.collective_timeout_s,
                        name="the trainer ranks' control group", peers=peers)


def train_and_close(config: GRPOJobConfig, policy: Policy, rollouts: Rollouts, pad_token_id: int,
                    device: torch.device, trainers: ControlGroup, resume: bool, *,
                    stops: StopSignals | None = None) -> dict:
    """:func:`train`, then close ``rollouts`` (after a failure, without waiting on peers, and
    not cut short by a stop signal: :meth:`StopSignals.unwinding`)."""
    try:
        summary = train(config, policy, rollouts, pad_token_id, device, trainers, resume)
    except BaseException:
        with unwinding(stops):
            rollouts.close(failed=True)
        raise
    rollouts.close()
    return summary


def unwinding(stops: StopSignals | None):
    """``stops.unwinding()``; nothing without stop signals."""
    return stops.unwinding() if stops is not None else contextlib.nullcontext()


def train(config: GRPOJobConfig, policy: Policy, rollouts: Rollouts, pad_token_id: int,
          device: torch.device, trainers: ControlGroup, resume: bool) -> dict:
    return run_grpo(config, policy=policy, rollouts=rollouts, pad_token_id=pad_token_id,
                    device=device, control=trainers, resume=resume)
