"""The inference engine in a process of its own, driven over a private pipe.

Colocated mode spawns one engine process per trainer rank, on the trainer's device; the trainer
sends commands (generate, release/reacquire memory, receive a refit) and waits for each reply with
a timeout. Messages are JSON bytes (never pickle), built and read only by the functions below:
:func:`encode_command` / :func:`decode_command` one way (``{"command", "kwargs"}``, a
:class:`~mcore_refit.inference.engine.SamplingConfig` as a plain dict), :func:`encode_reply` /
:func:`encode_failure` / :func:`decode_reply` the other (``{"ok": true, "value"}`` or
``{"ok": false, "error"}`` with the engine's traceback); completions travel as
:func:`completions_to_json`. An exception in the engine is raised in the trainer as
:class:`EngineError`; an engine that died is reported as such, never waited on forever.

The pipe is an anonymous ``multiprocessing`` connection between parent and child (not a socket),
so nothing outside the two processes can reach it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_refit.inference.engine import Completion, InferenceEngine, SamplingConfig
from mcore_refit.inference.vllm.engine import VllmEngine, VllmOptions
from mcore_refit.interrupts import reference, resolve, run_child
from mcore_refit.logs import (
    configure_logging,
    lock_progress_bars_within_the_process,
    logging_arguments,
)
from mcore_refit.processes import ProcessIdentity
from mcore_refit.refit import RefitError, TransportOptions, WeightTransferEndpoint


class EngineError(RuntimeError):
    """The engine process failed a command, died, or did not answer in time."""


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What an engine is built from: which engine, model, device, dtype, seed, refit transport
    options (and vLLM's sizing for ``engine="vllm"``)."""

    hf_path: str
    device: str
    dtype: str
    seed: int
    transport: TransportOptions
    # "hf": the embedded engine; "vllm": VllmEngine (``inference.engine``).
    engine: str = "hf"
    vllm: VllmOptions = dataclasses.field(default_factory=VllmOptions)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "transport": dataclasses.asdict(self.transport),
                "vllm": dataclasses.asdict(self.vllm)}

    @classmethod
    def from_json(cls, data: dict) -> EngineSpec:
        return cls(**{**data, "transport": TransportOptions(**data["transport"]),
                      "vllm": VllmOptions(**data.get("vllm", {}))})


def open_engine(spec: EngineSpec, *, device: torch.device):
    """``(engine, endpoint)``: the engine ``spec`` names on ``device`` and the refit endpoint
    that loads into it (the embedded engine's :class:`WeightTransferEndpoint`, or
    :class:`~mcore_refit.inference.vllm.transfer.VllmWeightTransfer` over vLLM's own calls).
    Both placements build their engines here: the colocated engine process and the inference
    ranks of a non-colocated job."""
    dtype = getattr(torch, spec.dtype)
    if spec.engine == "hf":
        engine = InferenceEngine(spec.hf_path, device=device, dtype=dtype, seed=spec.seed)
        return engine, WeightTransferEndpoint(engine=engine, device=device,
                                              options=spec.transport)
    if spec.engine == "vllm":
        engine = VllmEngine(spec.hf_path, device=device, dtype=dtype, seed=spec.seed,
                            options=spec.vllm)
        from mcore_refit.inference.vllm.transfer import VllmWeightTransfer

        return engine, VllmWeightTransfer(engine.llm, device=device, options=spec.transport)
    raise ValueError(f"unknown inference engine {spec.engine!r} (hf, vllm)")


class EngineProcess:
    """A spawned engine serving commands: by default an
    :class:`~mcore_refit.inference.engine.InferenceEngine` built from ``spec`` (see
    :class:`InferenceServer`). Call :meth:`close`.

    ``server`` is the class the process instantiates from ``spec.to_json()``; each command
    ``name`` calls its ``do_<name>`` method with JSON keyword arguments and returns its JSON
    value. Commands are sent with :meth:`submit` and their replies collected with :meth:`wait`,
    so the trainer can run its side of a refit between the two; :meth:`call` does both. A wait
    ends after ``timeout_s``, or within ``liveness_s`` of the process's death.
    """

    def __init__(self, spec, *, timeout_s: float, server: type | None = None,
                 liveness_s: float = TransportOptions.liveness_s) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._timeout_s = timeout_s
        self._liveness_s = liveness_s
        self._pending: str | None = None
        # The engine dies with the trainer; the launcher's SIGINT or SIGTERM, which reaches it
        # too (it signals the rank's process group), it ignores: the trainer stops its engine.
        # run_child sets both up before the engine imports torch (its arguments are plain data).
        self._process = context.Process(target=run_child,
                                        args=(os.getpid(), reference(_serve),
                                              reference(server or InferenceServer),
                                              json.dumps(spec.to_json()), child_conn,
                                              logging_arguments()),
                                        daemon=True, name=f"mcore_refit-engine-{spec.device}")
        self._process.start()
        child_conn.close()
        self.wait("start")

    @property
    def pid(self) -> int | None:
        """The engine process's id (for monitoring; the engine is a child of this process)."""
        return self._process.pid

    def alive_problem(self) -> str | None:
        """None while the engine process lives, else what happened to it."""
        if self._process.is_alive():
            return None
        return f"the inference engine process (pid {self.pid}) exited with code " \
               f"{self._process.exitcode}"

    def call(self, command: str, **kwargs: Any) -> Any:
        self.submit(command, **kwargs)
        return self.wait(command)

    def submit(self, command: str, **kwargs: Any) -> None:
        if self._pending is not None:
            raise RuntimeError(f"command {command!r} sent while {self._pending!r} is pending")
        self._check_alive(command)
        try:
            self._conn.send_bytes(encode_command(command, kwargs))
        except OSError:  # it died since the check: the pipe is broken
            self._process.join(timeout=5)  # reap it, for its exit code
            self._check_alive(command)
            raise
        self._pending = command

    def wait(self, command: str) -> Any:
        """The reply to the pending ``command``; raises EngineError on failure or timeout."""
        if command != "start" and self._pending != command:
            raise RuntimeError(f"waiting for {command!r} but {self._pending!r} is pending")
        # A dead engine's end of the pipe reads as closed, unless a process it started still
        # holds it: its exit code is checked too, every liveness_s.
        deadline = time.monotonic() + self._timeout_s
        while not self._conn.poll(min(self._liveness_s,
                                      max(0.0, deadline - time.monotonic()))):
            problem = self.alive_problem()
            if problem is not None:
                self._pending = None
                raise EngineError(f"{problem} during {command!r}")
            if time.monotonic() >= deadline:
                raise EngineError(f"the inference engine did not answer {command!r} within "
                                  f"{self._timeout_s:.0f}s")
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):  # OSError: it died with our command unread (reset)
            self._process.join(timeout=5)  # reap it, for its exit code
            raise EngineError(f"{self.alive_problem() or 'the inference engine closed its pipe'}"
                              f" during {command!r}") from None
        finally:
            self._pending = None
        return decode_reply(data, command)

    def _check_alive(self, command: str) -> None:
        problem = self.alive_problem()
        if problem is not None:
            raise EngineError(f"{problem}; cannot run {command!r}")

    def close(self) -> None:
        """Stop the engine: a clean shutdown when it is idle; killed when a command is still
        pending (it may be blocked in a refit whose trainer side gave up) or it does not stop."""
        if self._process.is_alive():
            try:
                if self._pending is None:
                    with contextlib.suppress(OSError):  # it may have died since the check
                        self._conn.send_bytes(encode_command("shutdown", {}))
                    self._process.join(timeout=30)
            finally:
                if self._process.is_alive():
                    self._process.kill()
                    self._process.join(timeout=10)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def receive_weight_update(endpoint, engine, weight_version: int) -> dict:
    """One refit into ``engine`` through ``endpoint``, labelled ``weight_version``.

    On failure the endpoint's update is closed (keeping the old version label) and the original
    error propagates; on success the engine may generate again. Returns the receiver telemetry.
    """
    endpoint.start_weight_update()
    try:
        telemetry = endpoint.update_weights()
    except BaseException:
        with contextlib.suppress(RefitError):
            endpoint.finish_weight_update(weight_version)
        raise
    endpoint.finish_weight_update(weight_version)
    engine.mark_weights_loaded()
    return telemetry.as_dict()


# --- the pipe's messages ----------------------------------------------------------------------

def encode_command(command: str, kwargs: Mapping[str, Any]) -> bytes:
    """The message asking the engine process to run ``command`` with keyword arguments
    ``kwargs`` (JSON values, or a :class:`SamplingConfig`, sent as its dict)."""
    return json.dumps({"command": command, "kwargs": _plain(kwargs)}).encode()


def decode_command(data: bytes) -> tuple[str, dict[str, Any]]:
    """``(command, kwargs)`` from a message of :func:`encode_command` (the engine's side)."""
    message = json.loads(data.decode())
    return message["command"], message["kwargs"]


def encode_reply(value: Any) -> bytes:
    """The engine's answer to a command that succeeded: its JSON ``value``."""
    return json.dumps({"ok": True, "value": value}).encode()


def encode_failure(error: BaseException) -> bytes:
    """The engine's answer to a command that raised ``error``: its full traceback text."""
    return json.dumps({"ok": False,
                       "error": "".join(traceback.format_exception(error))}).encode()


def decode_reply(data: bytes, command: str) -> Any:
    """The value of a reply to ``command``; :class:`EngineError` with the engine's traceback if
    the command failed there, or if the reply is not a message of this pipe."""
    try:
        reply = json.loads(data.decode())
        ok = reply["ok"]
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
        raise EngineError(f"the inference engine answered {command!r} with a malformed "
                          f"message: {data[:200]!r}") from None
    if not ok:
        raise EngineError(f"the inference engine failed {command!r}:\n{reply['error']}")
    return reply["value"]


def completions_to_json(groups: Sequence[Sequence[Completion]]) -> list[list[dict]]:
    """Completion groups (one per prompt) as plain JSON data."""
    return [[completion.to_json() for completion in group] for group in groups]


def completions_from_json(data: Sequence[Sequence[dict]]) -> list[list[Completion]]:
    """The completion groups :func:`completions_to_json` made."""
    return [[Completion.from_json(completion) for completion in group] for group in data]


def _plain(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value.to_json() if isinstance(value, SamplingConfig) else value
            for key, value in kwargs.items()}


# --- the engine process ----------------------------------------------------------------------

def _serve(server_ref: str, spec_json: str, conn, logging_kwargs: dict | None) -> None:
    """Engine process main loop (under :func:`~mcore_refit.interrupts.run_child`): build the
    ``server_ref`` class (a :func:`~mcore_refit.interrupts.reference`), then answer commands
    until shutdown. Exits at once if the trainer that spawned it dies, whatever it is doing.
    Logs where the trainer logs (``logging_kwargs``: its :func:`configure_logging` call)."""
    _exit_with_parent(interval_s=json.loads(spec_json).get(
        "transport", {}).get("liveness_s", 2.0))
    if logging_kwargs is not None:
        configure_logging(**logging_kwargs, process="engine")
    # Without configure_logging too: it leaves with os._exit, or is killed with its trainer.
    lock_progress_bars_within_the_process()
    try:
        server = resolve(server_ref)(json.loads(spec_json))
    except BaseException as error:
        conn.send_bytes(encode_failure(error))
        return
    conn.send_bytes(encode_reply(None))
    while True:
        try:
            command, kwargs = decode_command(conn.recv_bytes())
        except EOFError:  # the trainer went away
            break
        if command == "shutdown":
            break
        try:
            reply = encode_reply(getattr(server, f"do_{command}")(**kwargs))
        except BaseException as error:
            reply = encode_failure(error)
        conn.send_bytes(reply)
    server.close()
    # Nothing left to save: skip the interpreter's teardown (seconds with torch loaded), so the
    # trainer's close() returns at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent(*, interval_s: float) -> None:
    """Besides the parent-death signal (Linux; see ``run_child``), a thread that ends this
    process once its parent (the trainer) is gone: checked every ``interval_s`` (the parent's
    identity, so a reused pid does not fool it)."""
    parent = ProcessIdentity.of(os.getppid())

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent.pid or parent.gone():
                print(f"the trainer process ({parent.describe()}) that started this engine "
                      f"died; the engine (pid {os.getpid()}) exits", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="mcore_refit-engine-parent-watch", daemon=True).start()


class InferenceServer:
    """The command handlers of an inference engine process (JSON in, JSON out)."""

    def __init__(self, spec_json: dict) -> None:
        spec = EngineSpec.from_json(spec_json)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.engine, self.endpoint = open_engine(spec, device=device)

    def do_init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        self.endpoint.init_weight_transfer_engine(init_info)

    def do_update_weights(self, weight_version: int) -> dict:
        return receive_weight_update(self.endpoint, self.engine, weight_version)

    def do_generate(self, prompts, num_samples, sampling, seed=None) -> list[list[dict]]:
        return completions_to_json(self.engine.generate(
            prompts, num_samples=num_samples, sampling=SamplingConfig.from_json(sampling),
            seed=seed))

    def do_release_memory(self) -> None:
        self.engine.release_memory()

    def do_reacquire_memory(self) -> None:
        self.engine.reacquire_memory()

    def close(self) -> None:
        self.endpoint.close()

