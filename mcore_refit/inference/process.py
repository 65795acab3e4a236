"""The inference engine in a process of its own, driven over a private pipe.

Colocated mode spawns one engine process per trainer rank, on the trainer's device; the trainer
sends commands (generate, release/reacquire memory, receive a refit) and waits for each reply with
a timeout. An exception in the engine comes back with its traceback and is raised in the trainer
as :class:`EngineError`; an engine that died is reported as such, never waited on forever.

The pipe is an anonymous ``multiprocessing`` connection between parent and child (not a socket),
so nothing outside the two processes can reach it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mcore_refit.refit.config import RefitConfig


class EngineError(RuntimeError):
    """The engine process failed a command, died, or did not answer in time."""


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What the engine process builds: model, device, dtype, seed, refit settings."""

    hf_path: str
    device: str
    dtype: str
    seed: int
    refit: RefitConfig


class EngineProcess:
    """A spawned :class:`~mcore_refit.inference.engine.InferenceEngine`. Call :meth:`close`.

    Commands are sent with :meth:`submit` and their replies collected with :meth:`wait`, so the
    trainer can run its side of a refit between the two; :meth:`call` does both.
    """

    def __init__(self, spec: EngineSpec, *, timeout_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._timeout_s = timeout_s
        self._pending: str | None = None
        self._process = context.Process(target=_serve, args=(spec, child_conn), daemon=True,
                                        name=f"mcore_refit-engine-{spec.device}")
        self._process.start()
        child_conn.close()
        self.wait("start")

    @property
    def pid(self) -> int | None:
        """The engine process's id (for monitoring; the engine is a child of this process)."""
        return self._process.pid

    def call(self, command: str, **kwargs: Any) -> Any:
        self.submit(command, **kwargs)
        return self.wait(command)

    def submit(self, command: str, **kwargs: Any) -> None:
        if self._pending is not None:
            raise RuntimeError(f"command {command!r} sent while {self._pending!r} is pending")
        self._check_alive(command)
        self._conn.send((command, kwargs))
        self._pending = command

    def wait(self, command: str) -> Any:
        """The reply to the pending ``command``; raises EngineError on failure or timeout."""
        if command != "start" and self._pending != command:
            raise RuntimeError(f"waiting for {command!r} but {self._pending!r} is pending")
        if not self._conn.poll(self._timeout_s):
            self._check_alive(command)
            raise EngineError(f"the inference engine did not answer {command!r} within "
                              f"{self._timeout_s:.0f}s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise EngineError(f"the inference engine process died during {command!r} "
                              f"(exit code {self._process.exitcode})") from None
        finally:
            self._pending = None
        if status == "error":
            raise EngineError(f"the inference engine failed {command!r}:\n{payload}")
        return payload

    def _check_alive(self, command: str) -> None:
        if not self._process.is_alive():
            raise EngineError(f"the inference engine process is dead (exit code "
                              f"{self._process.exitcode}); cannot run {command!r}")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                if self._pending is None:
                    self._conn.send(("shutdown", {}))
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
    from mcore_refit.refit.transport import RefitError

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


def _serve(spec: EngineSpec, conn) -> None:
    """Engine process main loop: build, then answer commands until shutdown."""
    try:
        server = _EngineServer(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:  # the trainer went away
            break
        if command == "shutdown":
            break
        try:
            result = getattr(server, f"do_{command}")(**kwargs)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        else:
            conn.send(("ok", result))
    server.close()


class _EngineServer:
    """The command handlers that run inside the engine process."""

    def __init__(self, spec: EngineSpec) -> None:
        from mcore_refit.inference.engine import InferenceEngine
        from mcore_refit.refit.receiver import WeightTransferEndpoint

        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.engine = InferenceEngine(spec.hf_path, device=device,
                                      dtype=getattr(torch, spec.dtype), seed=spec.seed)
        self.endpoint = WeightTransferEndpoint(engine=self.engine, device=device,
                                               config=spec.refit)

    def do_init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        self.endpoint.init_weight_transfer_engine(init_info)

    def do_update_weights(self, weight_version: int) -> dict:
        return receive_weight_update(self.endpoint, self.engine, weight_version)

    def do_generate(self, prompts, num_samples, sampling):
        return self.engine.generate(prompts, num_samples=num_samples, sampling=sampling)

    def do_release_memory(self) -> None:
        self.engine.release_memory()

    def do_reacquire_memory(self) -> None:
        self.engine.reacquire_memory()

    def close(self) -> None:
        self.endpoint.close()
