"""Colocated transport on CPU: the trainer in the test process, the engine in a fresh process.

Same protocol as on GPU (ZMQ REQ/REP, ACK before reuse, COMPLETE summary) with shared-memory
buffers instead of CUDA IPC handles. Round trips must be bitwise exact; every failure must be a
RefitError on the trainer naming its cause, within the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import zmq

from mcore_refit.bench.synthetic import SyntheticWeightSource, TensorListSource, tiny_mixed_specs
from mcore_refit.refit import (
    ColocatedInitInfo,
    ColocatedSender,
    LocalSource,
    Piecewise,
    PlanConfig,
    RefitError,
    Refitter,
    RefitTimeout,
    SharedMemoryParameters,
    SharedWeightsSender,
    TensorDictEngine,
    TensorSpec,
    TransportOptions,
    WeightTransferEndpoint,
    build_plan,
    plan_for_source,
)
from mcore_refit.refit.transports.ipc_files import create_shared_cpu_slot, private_runtime_dir
from mcore_refit.refit.transports.wire import BufferReady, decode, encode
from tests.ranks import process_context
from tests.tensors import bits

CPU = torch.device("cpu")
SEED = 11



def _bump(source) -> None:
    for _, tensor in source.iter_weights():
        tensor.add_(1)


def _options(ipc_dir: str, **overrides) -> TransportOptions:
    values = {"checksums": True, "timeout_s": 5.0, "start_timeout_s": 30.0, "ipc_dir": ipc_dir}
    return TransportOptions(**{**values, **overrides})


def _plan_config(num_slots: int = 2) -> PlanConfig:
    return PlanConfig(slot_bytes=2048, num_slots=num_slots)


class _ScriptedEngine(TensorDictEngine):
    """Fails as told per refit: ``{refit: ("raise" | "kill", on_call)}``."""

    def __init__(self, targets, script: dict) -> None:
        super().__init__(targets, description="the scripted engine")
        self.script = script
        self.refit = 0
        self.calls = 0

    def load_weights(self, weights) -> None:
        self.calls += 1
        action = self.script.get(self.refit)
        if action is not None and self.calls == action[1]:
            if action[0] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"engine exploded in refit {self.refit} on call {self.calls}")
        super().load_weights(weights)


def engine_main(address: str, options: TransportOptions, out_path: str, num_refits: int,
                script: dict, drop_name: str | None, own_plan_json: str | None,
                trainer_refits_before: int) -> None:
    """The engine process: serve ``num_refits`` refits, compare with the expected weights."""
    from mcore_refit.refit import plan_from_json

    specs = tiny_mixed_specs()
    base = TensorDictEngine.from_specs([s for s in specs if s.name != drop_name], device=CPU)
    engine = _ScriptedEngine({n: base.get_weight(n) for n in base.names}, script)
    expected = SyntheticWeightSource(specs, device=CPU, seed=SEED, noncontiguous=True)
    for _ in range(trainer_refits_before):
        _bump(expected)
    plan = plan_from_json(own_plan_json) if own_plan_json else None
    outcomes = []
    try:
        with WeightTransferEndpoint(engine=engine, device=CPU, options=options,
                                    plan=plan) as endpoint:
            endpoint.init_weight_transfer_engine(ColocatedInitInfo(address=address))
            for refit in range(num_refits):
                engine.refit, engine.calls = refit, 0
                endpoint.start_weight_update()
                try:
                    telemetry = endpoint.update_weights()
                    endpoint.finish_weight_update(refit)
                    outcome = {"ok": True, "verified": telemetry.verified,
                               "refit_index": telemetry.refit_index,
                               "bitwise": all(torch.equal(bits(engine.get_weight(n)), bits(t))
                                              for n, t in expected.iter_weights())}
                except RefitError as error:
                    outcome = {"ok": False, "type": type(error).__name__, "message": str(error)}
                    try:
                        endpoint.finish_weight_update(refit)
                    except RefitError as refused:
                        outcome["finish"] = str(refused)
                outcomes.append(outcome)
                _bump(expected)  # the trainer bumps its weights after every refit
    except BaseException as error:
        outcomes.append({"uncaught": f"{type(error).__name__}: {error}",
                         "traceback": traceback.format_exc()})
    Path(out_path).write_text(json.dumps(outcomes))


def start_engine(address: str, options: TransportOptions, out_path: Path, *, num_refits: int,
                 script: dict | None = None, drop_name: str | None = None,
                 own_plan_json: str | None = None, trainer_refits_before: int = 0):
    process = process_context().Process(
        target=engine_main, args=(address, options, str(out_path), num_refits, script or {},
                                  drop_name, own_plan_json, trainer_refits_before))
    process.start()
    return process


def finish_engine(process, out_path: Path, timeout_s: float = 30.0):
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError("the engine process did not finish")
    return json.loads(out_path.read_text()) if out_path.exists() else None


class Trainer:
    """The trainer side, in the test process."""

    def __init__(self, options: TransportOptions, *, device_id: str, num_slots: int = 2) -> None:
        self.source = SyntheticWeightSource(tiny_mixed_specs(), device=CPU, seed=SEED,
                                            noncontiguous=True)
        plan = plan_for_source(LocalSource(self.source), config=_plan_config(num_slots),
                               device=CPU)
        sender = ColocatedSender(plan=plan, device=CPU, options=options, cpu_device_id=device_id)
        self.refitter = Refitter(source=LocalSource(self.source), sender=sender)
        self.refitter.prepare()
        self.address = sender.address

    def refit(self, **kwargs):
        try:
            return self.refitter.refit(**kwargs)
        finally:
            _bump(self.source)

    def use(self, source) -> None:
        self.refitter.source = LocalSource(source)

    def close(self) -> None:
        self.refitter.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_colocated_round_trip_bitwise(ipc_dir, tmp_path, num_slots):
    config = _options(ipc_dir)
    trainer = Trainer(config, device_id=f"cpu-rt{num_slots}", num_slots=num_slots)
    private = private_runtime_dir(ipc_dir)
    assert trainer.address == f"ipc://{private}/cpu-rt{num_slots}.sock"
    slot_files = sorted(p.name for p in private.glob("*.slot*"))
    assert len(slot_files) == trainer.refitter.plan.num_held_slots
    assert all(os.stat(private / f).st_mode & 0o777 == 0o600 for f in slot_files)
    engine = start_engine(trainer.address, config, tmp_path / "engine.json", num_refits=3)
    try:
        first = trainer.refit(verify=True)
        second = trainer.refit(verify=False)
        third = trainer.refit(verify=True)
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    assert not list(private.iterdir())  # socket and shared-memory files removed on close
    assert [o.get("bitwise") for o in outcomes] == [True, True, True], outcomes
    assert [o["verified"] for o in outcomes] == [True, None, True]
    assert [o["refit_index"] for o in outcomes] == [0, 1, 2]
    assert first.verified is True and third.verified is True and second.verified is None
    plan = trainer.refitter.plan
    assert first.payload_bytes == plan.payload_bytes and first.num_buffers == plan.num_buffers > 3
    assert first.held_bytes == plan.held_bytes
    assert any(b.oversized for b in plan.buffers)


@pytest.mark.timeout(90)
def test_colocated_unknown_name_and_mid_refit_raise(ipc_dir, tmp_path):
    config = _options(ipc_dir)
    trainer = Trainer(config, device_id="cpu-names")
    engine = start_engine(trainer.address, config, tmp_path / "engine.json", num_refits=3,
                          script={1: ("raise", 2)}, drop_name="head.weight")
    try:
        with pytest.raises(RefitError) as unknown:
            trainer.refit()
        with pytest.raises(RefitError) as raised:
            trainer.refit()
        with pytest.raises(RefitError) as unknown_again:
            trainer.refit()
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    plan = trainer.refitter.plan
    last = plan.buffers[-1]
    assert plan.names[last.stop_tensor - 1] == "head.weight"
    assert str(unknown.value).startswith(
        f"the engine failed on buffer {last.index} of refit 0 (tensors 'head.weight' .. "
        "'head.weight'): buffer")
    assert "ValueError: unknown weight name 'head.weight': the scripted engine has no " \
           "parameter or buffer of that name" in str(unknown.value)
    assert str(raised.value).startswith("the engine failed on buffer 1 of refit 1")
    assert "RuntimeError: engine exploded in refit 1 on call 2" in str(raised.value)
    assert "unknown weight name 'head.weight'" in str(unknown_again.value)
    assert [o["ok"] for o in outcomes] == [False, False, False]
    assert outcomes[0]["message"].startswith("refit 0 failed on the engine: buffer")
    assert outcomes[0]["finish"].startswith("the update to weight version 0 failed")
    assert "engine exploded in refit 1 on call 2" in outcomes[1]["message"]


@pytest.mark.timeout(90)
def test_a_refit_after_an_engine_failure_is_bitwise(ipc_dir, tmp_path):
    """The engine fails on the first buffer while the trainer has already announced the next
    ones; their late replies must not be taken for the next refit's."""
    config = _options(ipc_dir)
    trainer = Trainer(config, device_id="cpu-after-failure", num_slots=3)
    engine = start_engine(trainer.address, config, tmp_path / "engine.json", num_refits=2,
                          script={0: ("raise", 1)})
    try:
        with pytest.raises(RefitError, match="the engine failed on buffer 0 of refit 0"):
            trainer.refit()
        telemetry = trainer.refit(verify=True)
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    assert telemetry.verified is True
    assert [o["ok"] for o in outcomes] == [False, True]
    assert outcomes[1]["bitwise"] is True and outcomes[1]["refit_index"] == 1


def _in_shared_memory(source, directory: Path, name: str) -> TensorListSource:
    """``source``'s current values in shared-memory files (matrices stored transposed, so the
    engine rebuilds strided views)."""
    named = []
    for index, (tensor_name, tensor) in enumerate(source.iter_weights()):
        stored = tensor.t() if tensor.dim() == 2 else tensor
        nbytes = stored.numel() * stored.element_size()
        raw = create_shared_cpu_slot(directory / f"{name}.weights{index}", max(nbytes, 8))
        copy = raw[:nbytes].view(stored.dtype).view(stored.shape)
        copy.copy_(stored)
        named.append((tensor_name, copy.t() if tensor.dim() == 2 else copy))
    return TensorListSource(named)


def _shared_refitter(source, options: TransportOptions, device_id: str) -> Refitter:
    plan = plan_for_source(LocalSource(source), config=_plan_config(), device=CPU)
    sender = SharedWeightsSender(plan=plan, device=CPU, options=options, cpu_device_id=device_id)
    refitter = Refitter(source=LocalSource(source), sender=sender)
    refitter.prepare()
    return refitter


@pytest.mark.timeout(90)
def test_shared_weights_are_loaded_in_place_and_mapped_again_when_they_move(ipc_dir, tmp_path):
    config = _options(ipc_dir)
    directory = private_runtime_dir(ipc_dir)
    synthetic = SyntheticWeightSource(tiny_mixed_specs(), device=CPU, seed=SEED,
                                      noncontiguous=True)
    source = _in_shared_memory(synthetic, directory, "first")
    refitter = _shared_refitter(source, config, "cpu-shared")
    engine = start_engine(refitter.sender.address, config, tmp_path / "engine.json",
                          num_refits=3)
    try:
        telemetry = [refitter.refit(verify=True)]
        _bump(source)
        telemetry.append(refitter.refit(verify=True))
        _bump(source)
        # The weights move (as an offload and reload would move them): mapped again.
        refitter.source = LocalSource(_in_shared_memory(source, directory, "moved"))
        telemetry.append(refitter.refit(verify=True))
    finally:
        refitter.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    assert outcomes == [{"ok": True, "verified": True, "refit_index": i, "bitwise": True}
                        for i in range(3)]
    assert [(t.verified, t.transport, t.held_bytes) for t in telemetry] == \
        [(True, "colocated_weights", 0)] * 3


class _FusedSource:
    """A fused QKV-like weight in a shared-memory file, exported as the query rows of each of
    its two groups (runs of one storage, never copied), the key rows the same way, the value
    rows as one strided view, and an empty tensor."""

    stable_tensors = True
    GROUPS, QUERY_ROWS, ROW = 2, 3, 4
    SPECS = [TensorSpec("q", (GROUPS * QUERY_ROWS, ROW), torch.float32),
             TensorSpec("k", (GROUPS, ROW), torch.float32),
             TensorSpec("v", (GROUPS, ROW), torch.float32),
             TensorSpec("empty", (0, ROW), torch.float32)]

    def __init__(self, directory: Path) -> None:
        group = self.QUERY_ROWS + 2
        nbytes = self.GROUPS * group * self.ROW * 4
        raw = create_shared_cpu_slot(directory / "fused.weights0", nbytes)
        self.fused = raw.view(torch.float32).view(self.GROUPS, group, self.ROW)
        self.fused.copy_(_fused_values(0))
        self.q = Piecewise(shape=self.SPECS[0].shape, dtype=torch.float32, dim=0,
                           offsets=[g * self.QUERY_ROWS for g in range(self.GROUPS)],
                           runs=[self.fused[g, :self.QUERY_ROWS] for g in range(self.GROUPS)])
        self.k = Piecewise(shape=self.SPECS[1].shape, dtype=torch.float32, dim=0,
                           offsets=list(range(self.GROUPS)),
                           runs=[self.fused[g, self.QUERY_ROWS:self.QUERY_ROWS + 1]
                                 for g in range(self.GROUPS)])
        self.empty = torch.empty(0, self.ROW)

    def weight_specs(self):
        return list(self.SPECS)

    def iter_weights(self):
        yield from (("q", self.q), ("k", self.k), ("v", self.fused[:, -1]),
                    ("empty", self.empty))


def _fused_values(refit: int) -> torch.Tensor:
    group = _FusedSource.QUERY_ROWS + 2
    return torch.arange(_FusedSource.GROUPS * group * _FusedSource.ROW, dtype=torch.float32
                        ).view(_FusedSource.GROUPS, group, _FusedSource.ROW) * (refit + 1)


def _fused_engine_main(address: str, options: TransportOptions, out_path: str) -> None:
    engine = TensorDictEngine.from_specs(_FusedSource.SPECS, device=CPU)
    outcomes = []
    try:
        with WeightTransferEndpoint(engine=engine, device=CPU, options=options) as endpoint:
            endpoint.init_weight_transfer_engine(ColocatedInitInfo(address=address))
            for refit in range(2):
                endpoint.start_weight_update()
                telemetry = endpoint.update_weights()
                endpoint.finish_weight_update(refit)
                fused, rows = _fused_values(refit), _FusedSource.QUERY_ROWS
                expected = {"q": fused[:, :rows].reshape(-1, _FusedSource.ROW),
                            "k": fused[:, rows], "v": fused[:, -1]}
                outcomes.append({"verified": telemetry.verified, "bitwise": all(
                    torch.equal(engine.get_weight(n), t) for n, t in expected.items())})
    except BaseException as error:
        outcomes.append({"uncaught": f"{type(error).__name__}: {error}",
                         "traceback": traceback.format_exc()})
    Path(out_path).write_text(json.dumps(outcomes))


@pytest.mark.timeout(90)
def test_shared_weights_load_rows_that_lie_apart_as_runs_of_the_trainer_memory(ipc_dir,
                                                                               tmp_path):
    config = _options(ipc_dir)
    source = _FusedSource(private_runtime_dir(ipc_dir))
    refitter = _shared_refitter(source, config, "cpu-runs")
    engine = process_context().Process(
        target=_fused_engine_main,
        args=(refitter.sender.address, config, str(tmp_path / "engine.json")))
    engine.start()
    try:
        first = refitter.refit(verify=True)
        source.fused.copy_(_fused_values(1))  # in place: nothing is shared again
        second = refitter.refit(verify=True)
    finally:
        refitter.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    assert outcomes == [{"verified": True, "bitwise": True}] * 2
    assert (first.held_bytes, second.held_bytes, second.pack_s) == (0, 0, 0)


@pytest.mark.timeout(90)
def test_module_parameters_moved_to_shared_memory_are_refitted_in_place(ipc_dir, tmp_path):
    """A module built in private memory: its parameters, moved into a shared-memory file, keep
    their identity and values, and the engine loads them in place, after an in-place update too;
    closing removes the file and its owner record."""
    config = _options(ipc_dir)
    module = torch.nn.Module()  # the scripted engine's weights (every dtype, 0-dim, empty)
    names = {}
    for name, tensor in SyntheticWeightSource(tiny_mixed_specs(), device=CPU, seed=SEED,
                                              noncontiguous=True).iter_weights():
        names[name.replace(".", "_")] = name
        module.register_parameter(name.replace(".", "_"), torch.nn.Parameter(
            tensor.clone(), requires_grad=tensor.is_floating_point()))
    before = {name: bits(parameter).clone() for name, parameter in module.named_parameters()}
    identities = {name: id(parameter) for name, parameter in module.named_parameters()}
    shared = SharedMemoryParameters([module], ipc_dir=ipc_dir)
    try:
        assert {name: id(p) for name, p in module.named_parameters()} == identities
        assert all(torch.equal(bits(p), before[name]) for name, p in module.named_parameters())
        assert {p.untyped_storage().filename for p in module.parameters()} == {str(shared.path)}
        source = TensorListSource([(names[n], p) for n, p in module.named_parameters()])
        refitter = _shared_refitter(source, config, "cpu-moved")
        engine = start_engine(refitter.sender.address, config, tmp_path / "engine.json",
                              num_refits=2)
        try:
            telemetry = [refitter.refit(verify=True)]
            with torch.no_grad():
                _bump(source)  # as an optimizer step would: in place
            telemetry.append(refitter.refit(verify=True))
        finally:
            refitter.close()
        outcomes = finish_engine(engine, tmp_path / "engine.json")
    finally:
        shared.close()
    assert outcomes == [{"ok": True, "verified": True, "refit_index": i, "bitwise": True}
                        for i in range(2)]
    assert [(t.verified, t.transport, t.held_bytes) for t in telemetry] == \
        [(True, "colocated_weights", 0)] * 2
    key = shared.path.name.rsplit(".", 1)[0]
    assert not list(shared.path.parent.glob(f"{key}.*"))


@pytest.mark.timeout(90)
def test_shared_weights_refuse_private_memory_by_name(ipc_dir, tmp_path):
    config = _options(ipc_dir)
    source = SyntheticWeightSource(tiny_mixed_specs(), device=CPU, seed=SEED)
    refitter = _shared_refitter(source, config, "cpu-private")
    engine = start_engine(refitter.sender.address, config, tmp_path / "engine.json",
                          num_refits=1)
    try:
        with pytest.raises(RefitError) as raised:
            refitter.refit()
    finally:
        refitter.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    reason = ("cannot share the weights with the engine: a CPU tensor is shared with the engine "
              f"only from a shared-memory file in {private_runtime_dir(ipc_dir)}; this one "
              "lives in private memory")
    assert str(raised.value) == f"refit 0 failed on trainer rank 0: {reason}"
    assert outcomes[0]["ok"] is False
    assert outcomes[0]["message"] == f"refit 0 failed: the trainer aborted refit 0: {reason}"


@pytest.mark.timeout(90)
def test_colocated_source_drift_aborts_both_sides(ipc_dir, tmp_path):
    config = _options(ipc_dir)
    trainer = Trainer(config, device_id="cpu-drift")
    engine = start_engine(trainer.address, config, tmp_path / "engine.json", num_refits=2)
    healthy = trainer.source
    drifting = TensorListSource([(n, t.double() if n == "layers.1.mlp.weight" else t)
                                 for n, t in healthy.iter_weights()])
    try:
        trainer.use(drifting)
        with pytest.raises(RefitError) as raised:
            trainer.refit()
        trainer.use(healthy)
        recovered = trainer.refit(verify=True)
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    drift = ("the weight source yielded 'layers.1.mlp.weight' (33, 7) torch.float64 at "
             "position 8, the refit plan expects 'layers.1.mlp.weight' (33, 7) torch.float16")
    assert str(raised.value).startswith("refit 0 failed on trainer rank 0: packing buffer ")
    assert drift in str(raised.value)
    assert outcomes[0]["type"] == "RefitError"
    assert outcomes[0]["message"].startswith("refit 0 failed: the trainer aborted refit 0: ")
    assert drift in outcomes[0]["message"]
    assert recovered.verified is True and outcomes[1]["ok"] is True
    assert outcomes[1]["bitwise"] is True
    assert outcomes[1]["refit_index"] == 1


@pytest.mark.timeout(90)
def test_colocated_plan_mismatch(ipc_dir, tmp_path):
    config = _options(ipc_dir)
    trainer = Trainer(config, device_id="cpu-plan")
    other = build_plan(tiny_mixed_specs(), slot_bytes=4096, num_slots=2)
    engine = start_engine(trainer.address, config, tmp_path / "engine.json", num_refits=1,
                          own_plan_json=other.to_json())
    try:
        with pytest.raises(RefitError) as raised:
            trainer.refit()
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    mine = trainer.refitter.plan
    expected = (f"refit plan mismatch: the engine holds plan {other.fingerprint[:16]} (10 "
                f"tensors), the trainer sent {mine.fingerprint[:16]} (10 tensors)")
    assert expected in str(raised.value)
    assert expected in outcomes[0]["message"] and outcomes[0]["type"] == "RefitError"


@pytest.mark.timeout(90)
def test_colocated_dead_engine_times_out_then_a_new_engine_works(ipc_dir, tmp_path):
    config = _options(ipc_dir, timeout_s=2.0)
    trainer = Trainer(config, device_id="cpu-dead")
    engine = start_engine(trainer.address, config, tmp_path / "dead.json", num_refits=2,
                          script={1: ("kill", 2)})
    trainer.refit()  # healthy: waits for the engine process to start and connect
    started = time.monotonic()
    with pytest.raises(RefitTimeout) as raised:
        trainer.refit()  # the engine dies while loading buffer 1
    assert time.monotonic() - started < 2.0 + 1.5
    message = str(raised.value)
    assert finish_engine(engine, tmp_path / "dead.json") is None and engine.exitcode == -9
    assert message == (f"timed out after 2 s waiting for the engine's ACK of buffer 1/"
                       f"{trainer.refitter.plan.num_buffers} of refit 1 at {trainer.address}; "
                       "is the engine process alive?")
    # A new engine process connects; the trainer sends its hello again and refits normally.
    engine = start_engine(trainer.address, config, tmp_path / "new.json", num_refits=1,
                          trainer_refits_before=2)
    try:
        telemetry = trainer.refit(verify=True)
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "new.json")
    assert telemetry.verified is True
    assert outcomes == [{"ok": True, "verified": True, "refit_index": 2, "bitwise": True}]


@pytest.mark.timeout(60)
def test_engine_times_out_when_the_trainer_is_gone(ipc_dir, tmp_path):
    trainer = Trainer(_options(ipc_dir), device_id="cpu-gone")
    engine = start_engine(trainer.address, _options(ipc_dir, start_timeout_s=3.0),
                          tmp_path / "engine.json", num_refits=2)
    try:
        trainer.refit()
    finally:
        trainer.close()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    assert outcomes[0]["ok"] is True
    assert outcomes[1]["type"] == "RefitTimeout"
    assert outcomes[1]["message"].startswith(
        "timed out after 3 s waiting for the trainer's start of a refit at ipc://")


@pytest.mark.timeout(60)
def test_engine_rejects_garbage_and_pickles(ipc_dir, tmp_path):
    """A same-user process that reaches the socket gets error replies, never code execution."""
    config = _options(ipc_dir, start_timeout_s=4.0)
    directory = private_runtime_dir(ipc_dir)
    address = f"ipc://{directory}/cpu-garbage.sock"
    context = zmq.Context()
    intruder = context.socket(zmq.REQ)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.bind(address)
    engine = start_engine(address, config, tmp_path / "engine.json", num_refits=1)
    import pickle

    replies = []
    try:
        for frames in ([b"garbage"], [pickle.dumps(os.system)],
                       encode(BufferReady(refit_index=0, buffer_index=0))):
            intruder.send_multipart(frames)
            assert intruder.poll(20000), "the engine did not reply"
            replies.append(decode(intruder.recv_multipart()))
    finally:
        intruder.close()
        context.term()
    outcomes = finish_engine(engine, tmp_path / "engine.json")
    assert [r.KIND for r in replies] == ["error", "error", "error"]
    assert replies[0].message.startswith("malformed message: message of 7 bytes")
    assert replies[1].message.startswith("malformed message: bad magic")
    assert replies[2].message == "unexpected buffer message before a start"
    assert outcomes[0]["type"] == "RefitTimeout"
