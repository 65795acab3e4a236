"""Refits into a vLLM engine running in this process, over the colocated transport (shared
memory on CPU), from a trainer in a thread of this process.

vLLM's parameters are checked three ways: the refit's own verification (the trainer's digests
of what arrived, and every vLLM parameter against a reference copy loaded by vLLM's plain
loader), and here, independently, against the fused tensors the checkpoint's tensors make
(``qkv_proj = [q; k; v]``, ``gate_up_proj = [gate; up]``), read back from the engine.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_refit.bench.synthetic import TensorListSource
from mcore_refit.refit import (
    ColocatedInitInfo,
    ColocatedSender,
    LocalSource,
    RefitError,
    Refitter,
    Region,
    SharedMemoryParameters,
    SharedWeightsSender,
    plan_for_source,
)
from mcore_refit.refit.config import PlanConfig, TransportOptions
from mcore_refit.tiny import write_tiny_checkpoint
from tests.tensors import bits
from tests.vllm_llm import LLAMA, running_llm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "llama"
    write_tiny_checkpoint(path, LLAMA)
    with running_llm(path) as llm:
        yield path, llm


class Trainer:
    """The checkpoint's tensors as a one-rank source, refitted over IPC."""

    def __init__(self, path: Path, options: TransportOptions, *, plan: PlanConfig,
                 device_id: str, own_tensors: bool = False) -> None:
        self.tensors = sorted(load_file(path / "model.safetensors").items())
        self._shared = None
        sender_class = ColocatedSender
        if own_tensors:
            # ipc_sharing: weights: vLLM's worker reads the trainer's own tensors, which on CPU
            # must live in a shared-memory file.
            module = torch.nn.Module()
            for index, (_, tensor) in enumerate(self.tensors):
                module.register_parameter(f"t{index}",
                                          torch.nn.Parameter(tensor, requires_grad=False))
            self._shared = SharedMemoryParameters([module], ipc_dir=options.ipc_dir)
            self.tensors = [(name, parameter) for (name, _), parameter
                            in zip(self.tensors, module.parameters(), strict=True)]
            options = dataclasses.replace(options, ipc_sharing="weights")
            sender_class = SharedWeightsSender
        source = LocalSource(TensorListSource(self.tensors))
        sender = sender_class(plan=plan_for_source(source, config=plan, device=CPU), device=CPU,
                              options=options, cpu_device_id=device_id)
        self.refitter = Refitter(source=source, sender=sender)
        self.refitter.prepare()
        self.address = sender.address

    def bump(self, amount: float) -> None:
        for _, tensor in self.tensors:
            tensor.add_(amount)

    def expected_vllm_parameters(self) -> dict[str, torch.Tensor]:
        return expected_vllm_parameters(self.tensors)

    def close(self) -> None:
        self.refitter.close()
        if self._shared is not None:
            self._shared.close()


def expected_vllm_parameters(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What vLLM's Llama computes with, made from the HF tensors without vLLM."""
    hf = dict(tensors)
    expected = {}
    for name, tensor in hf.items():
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name.removesuffix("q_proj.weight")
            expected[prefix + "qkv_proj.weight"] = torch.cat(
                [hf[prefix + f"{p}_proj.weight"] for p in "qkv"])
        elif name.endswith("mlp.gate_proj.weight"):
            prefix = name.removesuffix("gate_proj.weight")
            expected[prefix + "gate_up_proj.weight"] = torch.cat(
                [hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]])
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            expected[name] = tensor
    return expected


def refit(trainer: Trainer, transfer, *, version: int, verify: bool = True) -> dict:
    """One refit: the trainer in a thread, the engine's four calls here."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["trainer"] = trainer.refitter.refit(verify=verify)
        except RefitError as error:
            outcome["trainer_error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    try:
        transfer.start_weight_update()
        try:
            outcome["engine"] = transfer.update_weights()
            transfer.finish_weight_update(version)
        except RefitError as error:
            outcome["engine_error"] = error
            with pytest.raises(RefitError, match="keep their previous version label"):
                transfer.finish_weight_update(version)
    finally:
        thread.join(60)
    assert not thread.is_alive(), "the trainer's refit did not return"
    return outcome


def vllm_mismatches(llm, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of vLLM parameters whose values (read back as vLLM computes with them) differ
    from ``expected``, bitwise; every vLLM parameter must be expected."""
    from mcore_refit.inference.vllm.verification import read_parameter

    def compare(worker) -> list[str]:
        model = worker.model_runner.get_model()
        names = {name for name, _ in model.named_parameters()}
        bad = sorted(names ^ set(expected))
        for name, tensor in expected.items():
            module_name, _, attribute = name.rpartition(".")
            value = read_parameter(model.get_submodule(module_name), attribute, tensor)
            if value is None or not torch.equal(bits(value), bits(tensor)):
                bad.append(name)
        return bad

    return llm.collective_rpc(compare)[0]


def staging_address(llm) -> int:
    return llm.collective_rpc(
        lambda worker: worker.weight_transfer_engine.loader._staging._memory.data_ptr())[0]


def options(ipc_dir: str) -> TransportOptions:
    return TransportOptions(checksums=True, timeout_s=30.0, start_timeout_s=60.0,
                            ipc_dir=ipc_dir)


def verified_refits(trainer: Trainer, llm, ipc_dir: str, *, count: int):
    """``count`` refits into ``llm``, each after changing the trainer's tensors: verified on
    both sides, and vLLM's parameters read back bitwise; yields each refit's outcome."""
    from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

    with VllmWeightTransfer(llm, device=CPU, options=options(ipc_dir)) as transfer:
        transfer.init_weight_transfer_engine(ColocatedInitInfo(address=trainer.address))
        for version in range(count):
            trainer.bump(0.25 * version)
            outcome = refit(trainer, transfer, version=version)
            assert outcome["trainer"].verified is True, outcome
            assert outcome["engine"].verified is True, outcome
            assert transfer.weight_version == version
            assert vllm_mismatches(llm, trainer.expected_vllm_parameters()) == []
            yield outcome


def test_vllm_refit_many_small_buffers_bitwise(llama, ipc_dir):
    """4 KiB slots: every attention and MLP tensor travels in a slot that the next buffer
    reuses while vLLM's layer is still incomplete; three refits with other weights each."""
    path, llm = llama
    trainer = Trainer(path, options(ipc_dir), plan=PlanConfig(slot_bytes=4096, num_slots=2),
                      device_id="vllm-small")
    assert trainer.refitter.plan.num_buffers >= 30
    staged_at = []
    try:
        for outcome in verified_refits(trainer, llm, ipc_dir, count=3):
            # vLLM's loader figures travel in the telemetry: merged calls, at most one per
            # buffer.
            figures = outcome["engine"].engine
            assert 1 <= figures["load_calls"] <= trainer.refitter.plan.num_buffers, figures
            assert figures["load_s"] > 0 and figures["wait_s"] >= 0, figures
            staged_at.append(staging_address(llm))
    finally:
        trainer.close()
    assert len(set(staged_at)) == 1  # the staging is allocated once, not per refit


def test_vllm_refit_from_a_slot_per_buffer_reads_the_slots_uncopied(llama, ipc_dir):
    """Slots enough for every buffer: none is refilled during a refit, so vLLM reads each
    buffer where it arrived, with no staged copy (the engine holds no staging); bitwise, three
    refits, each verified. After the refit, the tensors vLLM was given are the slots."""
    path, llm = llama
    probe = Trainer(path, options(ipc_dir), plan=PlanConfig(slot_bytes=1 << 18, num_slots=2),
                    device_id="vllm-held-probe")
    num_buffers = probe.refitter.plan.num_buffers
    probe.close()
    trainer = Trainer(path, options(ipc_dir),
                      plan=PlanConfig(slot_bytes=1 << 18, num_slots=num_buffers),
                      device_id="vllm-held")

    def staged_in_slots(worker) -> bool:
        loader = worker.weight_transfer_engine.loader
        slots = [slot.untyped_storage() for slot in
                 worker.weight_transfer_engine._receiver._slots.slots]
        spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in slots]
        return all(any(start <= t.data_ptr() < end for start, end in spans)
                   for _, t in loader.staged_weights())

    try:
        assert trainer.refitter.plan.slot_per_buffer and num_buffers > 2
        for outcome in verified_refits(trainer, llm, ipc_dir, count=3):
            assert outcome["engine"].held_bytes == trainer.refitter.plan.held_bytes
            assert llm.collective_rpc(staged_in_slots)[0]
    finally:
        trainer.close()


def test_vllm_refit_reads_the_trainers_own_tensors_from_shared_memory(llama, ipc_dir):
    """ipc_sharing: weights on CPU: the trainer's tensors, moved into a shared-memory file, go
    into vLLM with no slots, no packing and no staged copy; bitwise, twice (the second after an
    in-place update of the trainer's tensors). Once the refit returned, vLLM holds nothing of
    the trainer's memory: changing it leaves vLLM's parameters as refitted."""
    from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

    path, llm = llama
    trainer = Trainer(path, options(ipc_dir), plan=PlanConfig(slot_bytes=65536, num_slots=2),
                      device_id="vllm-own", own_tensors=True)
    try:
        with VllmWeightTransfer(llm, device=CPU, options=options(ipc_dir)) as transfer:
            transfer.init_weight_transfer_engine(ColocatedInitInfo(address=trainer.address))
            for version in range(2):
                trainer.bump(0.5 * version)
                outcome = refit(trainer, transfer, version=version)
                sent = outcome["trainer"]
                assert (sent.verified, sent.transport, sent.held_bytes) == \
                    (True, "colocated_weights", 0), outcome
                assert outcome["engine"].verified is True, outcome
                # Whole tensors only: one call, vLLM read them where they are, nothing staged.
                assert outcome["engine"].engine["load_calls"] == 1
                assert outcome["engine"].held_bytes == 0, outcome
                assert vllm_mismatches(llm, trainer.expected_vllm_parameters()) == []
            refitted = {name: tensor.clone()
                        for name, tensor in trainer.expected_vllm_parameters().items()}
            trainer.bump(1.0)
            assert vllm_mismatches(llm, refitted) == []
    finally:
        trainer.close()


def test_vllm_load_in_place_names_pieces_that_do_not_cover_and_stops_reading(llama):
    """A refit loaded in place whose pieces leave a tensor incomplete is refused naming it, and
    vLLM has finished reading the tensors (the reload closed, no load running) when the error
    reaches the receiver, which then lets the trainer change them. The next refit loads."""
    path, llm = llama
    tensors = sorted(load_file(path / "model.safetensors").items())
    plan = plan_for_source(LocalSource(TensorListSource(tensors)),
                           config=PlanConfig(slot_bytes=65536, num_slots=2), device=CPU)
    name, q = next((name, t) for name, t in tensors if name.endswith("q_proj.weight"))
    half = q.shape[0] // 2
    wholes = [(other, t) for other, t in tensors if other != name]
    first_half = [(name, q[:half], Region(dim=0, start=0, full=q.shape[0]))]
    both_halves = [*first_half, (name, q[half:], Region(dim=0, start=half, full=q.shape[0]))]

    def load_twice(worker) -> tuple[str, bool, bool, bool, bool]:
        loader = worker.weight_transfer_engine.loader
        plan_of, loader._plan_of = loader._plan_of, lambda: plan
        try:
            loader.begin(timeout_s=30.0)
            with pytest.raises(ValueError) as refused:
                loader.load_weights_in_place(wholes, first_half)
            stopped = (loader._reloading, loader._pipeline.busy)
            loader.begin(timeout_s=30.0)
            # Views only the loader can keep alive, standing in for the trainer's memory.
            views = [(other, tensor.view_as(tensor)) for other, tensor in wholes]
            kept = weakref.ref(views[0][1])
            loader.load_weights_in_place(views, both_halves)
            del views
            held = kept() is not None
            loader.close()
            return str(refused.value), *stopped, held, kept() is None
        finally:
            loader._plan_of = plan_of

    message, reloading, loading, held, released = llm.collective_rpc(load_twice)[0]
    assert message == f"the pieces of 1 tensors do not cover them: [{name!r}]"
    assert (reloading, loading) == (False, False)
    assert vllm_mismatches(llm, expected_vllm_parameters(tensors)) == []
    # The verification reads them until the engine closes; closed, nothing here maps them.
    assert held and released


def test_vllm_refit_catches_views_kept_across_a_reused_slot(llama, ipc_dir, monkeypatch):
    """The trap: vLLM's layerwise reload keeps what it was given until a layer is complete.
    Handing it views of the transport's slots (staged copies kept aside, so the trainer's
    digests still pass) must be caught by the check of vLLM's parameters, naming them."""
    from mcore_refit.inference.vllm import staging
    from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

    path, llm = llama
    trainer = Trainer(path, options(ipc_dir), plan=PlanConfig(slot_bytes=4096, num_slots=2),
                      device_id="vllm-trap")
    staged = staging.RefitStaging.put

    def hand_over_slot_views(self, weights):
        weights = list(weights)
        staged(self, weights)
        return weights

    try:
        with VllmWeightTransfer(llm, device=CPU, options=options(ipc_dir)) as transfer:
            transfer.init_weight_transfer_engine(ColocatedInitInfo(address=trainer.address))
            trainer.bump(1.0)
            with monkeypatch.context() as patch:
                patch.setattr(staging.RefitStaging, "put", hand_over_slot_views)
                outcome = refit(trainer, transfer, version=1)
            for side in ("trainer_error", "engine_error"):
                assert "vLLM check failed" in str(outcome[side]), outcome
                assert "differ from what vLLM's own loader makes" in str(outcome[side])
            assert vllm_mismatches(llm, trainer.expected_vllm_parameters()) != []
            assert transfer.weight_version is None
            outcome = refit(trainer, transfer, version=2)  # staged again: exact
            assert outcome["engine"].verified is True, outcome
            assert vllm_mismatches(llm, trainer.expected_vllm_parameters()) == []
    finally:
        trainer.close()


def test_vllm_refit_plan_mismatch_is_named_on_both_sides(llama, ipc_dir):
    from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

    path, llm = llama
    trainer = Trainer(path, options(ipc_dir), plan=PlanConfig(slot_bytes=65536, num_slots=2),
                      device_id="vllm-plan")
    other = Trainer(path, options(ipc_dir), plan=PlanConfig(slot_bytes=32768, num_slots=2),
                    device_id="vllm-plan-other")
    try:
        with VllmWeightTransfer(llm, device=CPU, options=options(ipc_dir),
                                plan=other.refitter.plan) as transfer:
            transfer.init_weight_transfer_engine(ColocatedInitInfo(address=trainer.address))
            outcome = refit(trainer, transfer, version=0)
            for side in ("trainer_error", "engine_error"):
                assert "refit plan mismatch" in str(outcome[side]), outcome
                assert trainer.refitter.plan.fingerprint[:16] in str(outcome[side])
                assert other.refitter.plan.fingerprint[:16] in str(outcome[side])
    finally:
        trainer.close()
        other.close()


class _GroupedGemmMoE:
    """Stands for vLLM's CPU fused MoE on its grouped-GEMM path (CPUs without AMX)."""

    isa = "vec"

    def forward_grouped_gemm(self) -> None:
        pass

    @property
    def forward_method(self):
        return self.forward_grouped_gemm


def test_the_check_reads_moe_experts_in_the_layout_vllm_prepacked_them():
    """On CPUs without AMX vLLM's fused MoE prepacks the experts' weights in place (same shape,
    another order): the check prepacks the reference's the same way, and only those."""
    from types import SimpleNamespace

    from vllm._custom_ops import cpu_prepack_moe_weight

    from mcore_refit.inference.vllm.verification import as_the_engine_holds

    experts = torch.nn.Module()
    experts.quant_method = SimpleNamespace(cpu_fused_moe=_GroupedGemmMoE())
    loaded = torch.randn(8, 128, 64, generator=torch.Generator().manual_seed(0))
    packed = cpu_prepack_moe_weight(loaded, "vec")
    assert not torch.equal(packed, loaded)
    assert torch.equal(bits(as_the_engine_holds(experts, "w2_weight", loaded)), bits(packed))
    assert as_the_engine_holds(experts, "e_score_correction_bias", loaded) is loaded
    plain = torch.nn.Module()
    plain.quant_method = SimpleNamespace(cpu_fused_moe=None)
    assert as_the_engine_holds(plain, "w2_weight", loaded) is loaded
