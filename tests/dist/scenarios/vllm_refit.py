"""torchrun --nproc-per-node N vllm_refit.py --workdir DIR --out RESULTS.json --placement P
                 [--ipc-dir SHORT_DIR]
                 --layouts NAME [NAME ...]

Refits a tiny Megatron model, laid out as each named layout, into vLLM engines, twice per layout
(the weights change in between), each refit verified inside vLLM (the trainer's digests of what
arrived, and every vLLM parameter against vLLM's plain loader), and checked here against
Megatron-Bridge's own export of the same model, bit for bit.

- ``--placement non_colocated``: the first ranks train, the last rank is an inference rank
  running vLLM in its own process; each buffer is broadcast from the trainer rank that exports it.
- ``--placement colocated``: every rank trains and spawns an engine process running vLLM, fed
  over the IPC transport (shared memory on CPU); buffers move between trainer ranks first.

One vLLM engine per process serves every layout of a checkpoint: colocated ranks start a new
engine process for another checkpoint; a non-colocated launch takes layouts of one checkpoint.
Rank 0 writes ``{layout: {"rank<r>": result}}`` to --out.
"""

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

# vLLM's CPU environment as the GRPO recipe's engines get it (inference/vllm/engine.py), set
# before torch is imported (engine processes inherit it); TORCH_COMPILE_DISABLE: vLLM's sampler
# helpers run eagerly instead of costing a C++ build at each of the launch's engine starts.
os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                   "HF_HUB_OFFLINE": "1", "TORCH_COMPILE_DISABLE": "1"})

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Also where torch was imported before the environment was set (a rank forked from the tests'
# fork server): dynamo reads the switch at its import.
torch._dynamo.config.disable = True

from refit_layouts import (  # noqa: E402
    CPU,
    build,
    bump,
    kinds,
    launch_id,
    reference,
    share,
    start,
    written_checkpoint,
)

from mcore_refit import distributed  # noqa: E402
from mcore_refit.config import ParallelConfig  # noqa: E402
from mcore_refit.control import ControlGroup  # noqa: E402
from mcore_refit.inference.process import EngineProcess  # noqa: E402
from mcore_refit.refit import (  # noqa: E402
    ColocatedInitInfo,
    ColocatedSender,
    NonColocatedInitInfo,
    NonColocatedSender,
    RefitPlan,
    Refitter,
    plan_for_source,
)
from mcore_refit.refit.checksum import TensorDigester, mismatched_names  # noqa: E402
from mcore_refit.refit.config import PlanConfig, TransportOptions  # noqa: E402
from mcore_refit.refit.export import ModelExport  # noqa: E402
from mcore_refit.tiny import TinyModelSpec  # noqa: E402

# Head size 32 (vLLM's CPU attention refuses 16).
CHECKPOINTS = {
    "llama": TinyModelSpec(architecture="llama", num_layers=4, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_moe": TinyModelSpec(architecture="qwen3_moe", num_layers=2, hidden_size=128,
                               intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=8, num_experts_per_token=2,
                               moe_intermediate_size=64),
}
LAYOUTS = {
    "tp1": ("llama", ParallelConfig()),
    "pp2_vpp2": ("llama", ParallelConfig(pipeline=2, virtual_pipeline=2)),
    "tp2": ("llama", ParallelConfig(tensor=2)),
    "moe_ep2": ("qwen3_moe", ParallelConfig(expert=2)),
    # A slot for every buffer (see PLANS): vLLM reads whole tensors in the slots, uncopied.
    "tp2_held": ("llama", ParallelConfig(tensor=2)),
}
OPTIONS = TransportOptions(checksums=True, timeout_s=120, start_timeout_s=240)
# Small slots: many buffers, so shards and sources interleave and slots are reused within a
# refit while vLLM's layers are incomplete.
PLAN = PlanConfig(slot_bytes=65536, num_slots=2)
PLANS = {"tp2_held": PlanConfig(slot_bytes=1 << 18, num_slots=64)}
NUM_REFITS = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    # Colocated: the IPC transport's sockets, under a short path (a Unix socket's path has at
    # most ~100 characters); default DIR/ipc.
    parser.add_argument("--ipc-dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--placement", choices=["colocated", "non_colocated"], required=True)
    parser.add_argument("--layouts", nargs="+", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    workdir = Path(args.workdir)
    context, job = start(args.placement, rank=rank, world=world, num_inference_ranks=1)
    results, engine = {}, Engine(Path(args.ipc_dir or workdir / "ipc"), rank=rank)
    try:
        for name in args.layouts:
            checkpoint, parallel = LAYOUTS[name]
            path = written_checkpoint(workdir / checkpoint, CHECKPOINTS[checkpoint], rank=rank,
                                      job=job)
            plan = PLANS.get(name, PLAN)
            if job is None:
                results[name] = colocated(path, parallel, plan, context=context, engine=engine)
            elif job.is_trainer:
                results[name] = trainer(path, parallel, plan, job=job)
            else:
                results[name] = receiver(job, path)
    finally:
        engine.close()
    gathered = share(results, job, rank)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    distributed.shutdown()


def planned(export: ModelExport, config: PlanConfig, *, device) -> RefitPlan:
    """The refit plan of ``export``; a config with more slots than the default must give every
    buffer its own slot (else the layout would not test what it is named for)."""
    plan = plan_for_source(export, config=config, device=device)
    if config.num_slots > PLAN.num_slots and not plan.slot_per_buffer:
        raise AssertionError(f"{plan.num_buffers} buffers, {config.num_slots} slots: not one "
                             "slot per buffer")
    return plan


# --- non-colocated ------------------------------------------------------------------------------

def trainer(path: Path, parallel: ParallelConfig, plan_config: PlanConfig, *, job) -> dict:
    """A trainer rank of the non-colocated job: refits, then Bridge's export for the check."""
    trainers = dist.new_group(backend="gloo")
    try:
        model = build(path, parallel, job.context.device)
        export = ModelExport(model, control=ControlGroup(trainers, timeout_s=120),
                             device=job.context.device)
        plan = planned(export, plan_config, device=job.context.device)
        control = ControlGroup(job.refit_control, timeout_s=120)
        sender = NonColocatedSender(plan=plan, placement=job.placement, rank=job.context.rank,
                                 control=control,
                                 data_group=job.data_groups.get(job.context.rank),
                                 device=job.context.device, options=OPTIONS,
                                 cpu_device_id=f"vllm{launch_id()}")
        refits = []
        with Refitter(source=export, sender=sender) as refitter:
            refitter.prepare()
            for _ in range(NUM_REFITS):
                telemetry = refitter.refit(verify=True)
                names, table = reference(model)
                control.broadcast_json([names, table.tolist()] if job.context.rank == 0
                                       else None, src=0, what="Bridge's export digests")
                refits.append({"verified": telemetry.verified, "sources": list(plan.sources)})
                bump(model)
        return {"refits": refits, "kinds": kinds(export)}
    finally:
        distributed.destroy_model_parallel()


def receiver(job, path: Path) -> dict:
    """The inference rank: vLLM in this process receives every refit and is checked against
    Bridge's export."""
    from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

    control = ControlGroup(job.refit_control, timeout_s=120)
    llm = Engine.llm_for(path)
    info = NonColocatedInitInfo(placement=job.placement, receiver=job.context.rank,
                             control=control, data_groups=job.data_groups)
    checks = []
    with VllmWeightTransfer(llm, device=job.context.device, options=OPTIONS) as transfer:
        transfer.init_weight_transfer_engine(info)
        for version in range(NUM_REFITS):
            transfer.start_weight_update()
            telemetry = transfer.update_weights()
            transfer.finish_weight_update(version)
            names, table = control.broadcast_json(None, src=0, what="Bridge's export digests")
            checks.append({"verified": telemetry.verified, "weight_version":
                           transfer.weight_version, **check(llm, names, table)})
    return {"checks": checks}


# --- colocated ----------------------------------------------------------------------------------

def colocated(path: Path, parallel: ParallelConfig, plan_config: PlanConfig, *, context,
              engine: "Engine") -> dict:
    """Every rank trains and refits its own vLLM engine process over IPC."""
    trainers = dist.new_group(backend="gloo")
    try:
        model = build(path, parallel, context.device)
        control = ControlGroup(trainers, timeout_s=120)
        export = ModelExport(model, control=control, device=context.device)
        plan = planned(export, plan_config, device=context.device)
        options = engine.options
        sender = ColocatedSender(plan=plan, device=context.device, options=options,
                           cpu_device_id=f"vllm{launch_id()}-rank{context.rank}",
                           trainers=dist.group.WORLD, control=control, rank=context.rank,
                           peer_alive=engine.alive_problem)
        checks = []
        with Refitter(source=export, sender=sender) as refitter:
            refitter.prepare()
            engine.connect(path, sender.address)
            for version in range(NUM_REFITS):
                engine.process.submit("update_weights", weight_version=version)
                telemetry = refitter.refit(verify=True)
                served = engine.process.wait("update_weights")
                names, table = reference(model)
                checks.append({"verified": telemetry.verified, "sources": list(plan.sources),
                               **served, **engine.process.call("check", names=names,
                                                               table=table.tolist())})
                bump(model)
            engine.process.call("disconnect")
        return {"checks": checks, "kinds": kinds(export)}
    finally:
        distributed.destroy_model_parallel()


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs (``EngineProcess`` builds a server from its JSON)."""

    device: str
    transport: TransportOptions

    def to_json(self) -> dict:
        return {"device": self.device, "transport": dataclasses.asdict(self.transport)}


class Engine:
    """This rank's engine process (colocated): one per checkpoint, since a process holds one
    vLLM engine (a second one in the same process fails: vLLM's process groups are global)."""

    _llm = None  # (path, vllm.LLM) of this process

    def __init__(self, ipc_dir: Path, *, rank: int) -> None:
        self.options = dataclasses.replace(OPTIONS, ipc_dir=str(ipc_dir))
        Path(self.options.ipc_dir).mkdir(parents=True, exist_ok=True)
        self.process: EngineProcess | None = None
        self.path: Path | None = None

    @staticmethod
    def llm_for(path: Path):
        """This process's vLLM engine over ``path`` (started at the first call)."""
        from mcore_refit.bench.vllm import refittable_llm

        if Engine._llm is None:
            Engine._llm = (path, refittable_llm(path))
        if Engine._llm[0] != path:
            raise ValueError(f"this process's vLLM engine serves {Engine._llm[0]}, not {path}: "
                             "one engine per process (launch the layouts of another "
                             "checkpoint separately)")
        return Engine._llm[1]

    def connect(self, path: Path, address: str) -> None:
        if self.process is not None and self.path != path:
            self.close()
        if self.process is None:
            self.process = EngineProcess(EngineSpec(device="cpu", transport=self.options),
                                         timeout_s=600, server=VllmServer)
            self.path = path
        self.process.call("connect", hf_path=str(path), address=address)

    def alive_problem(self) -> str | None:
        return self.process.alive_problem() if self.process is not None else None

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None


class VllmServer:
    """The engine process: vLLM in this process, refitted through ``VllmWeightTransfer``."""

    def __init__(self, spec: dict) -> None:
        self.options = TransportOptions(**spec["transport"])
        self.transfer = None
        self.llm = None

    def do_connect(self, hf_path: str, address: str) -> None:
        from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

        self.llm = Engine.llm_for(Path(hf_path))
        self.transfer = VllmWeightTransfer(self.llm, device=CPU, options=self.options)
        self.transfer.init_weight_transfer_engine(ColocatedInitInfo(address=address))

    def do_update_weights(self, weight_version: int) -> dict:
        self.transfer.start_weight_update()
        telemetry = self.transfer.update_weights()
        self.transfer.finish_weight_update(weight_version)
        return {"engine_verified": telemetry.verified,
                "weight_version": self.transfer.weight_version}

    def do_check(self, names: list[str], table: list[list[int]]) -> dict:
        return check(self.llm, names, table)

    def do_disconnect(self) -> None:
        self.transfer.close()

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()


def check(llm, names: list[str], table: list[list[int]]) -> dict:
    """Bridge's export digests against what reached vLLM's worker (by name)."""
    def staged(worker) -> tuple[list[str], list[torch.Tensor]]:
        loader = worker.weight_transfer_engine.loader
        return loader._staging.names, [loader.get_weight(name).clone() for name in names]

    received, tensors = llm.collective_rpc(staged)[0]
    actual = TensorDigester(CPU).table(tensors)
    return {"mismatched": mismatched_names(names, torch.tensor(table), actual),
            "same_names": sorted(names) == sorted(received)}


if __name__ == "__main__":
    main()
