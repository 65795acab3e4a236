"""The rollout backends' pure pieces and the engine pipe: shard order, the JSON messages, a
spawned stand-in engine answering over the pipe."""

import json
import traceback

import pytest

from mcore_refit.grpo.rollouts import interleave
from mcore_refit.inference.engine import Completion, SamplingConfig
from mcore_refit.inference.process import (
    EngineError,
    EngineProcess,
    EngineSpec,
    _plain,
    completions_from_json,
    completions_to_json,
    decode_command,
    decode_reply,
    encode_command,
    encode_failure,
    encode_reply,
)
from mcore_refit.refit import TransportOptions


def test_interleave_undoes_strided_sharding():
    prompts = list(range(7))
    shards = [prompts[rank::3] for rank in range(3)]
    assert interleave(shards, 7) == prompts


def test_completions_and_sampling_round_trip_through_json():
    completion = Completion(prompt_ids=(5, 6), token_ids=(7, 2), logprobs=(-0.5, -1.25),
                            text="3", stopped=True)
    assert Completion.from_json(json.loads(json.dumps(completion.to_json()))) == completion
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=4, stop_token="</s>")
    assert SamplingConfig.from_json(json.loads(json.dumps(sampling.to_json()))) == sampling
    assert _plain({"sampling": sampling, "n": 2}) == {"sampling": sampling.to_json(), "n": 2}


def test_engine_spec_round_trips_through_json():
    spec = EngineSpec(hf_path="/ckpt", device="cuda:1", dtype="bfloat16", seed=3,
                      transport=TransportOptions(timeout_s=5.0, checksums=True))
    assert EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_engine_commands_round_trip_through_the_pipe_format():
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=4, stop_token=None)
    data = encode_command("generate", {"prompts": ["1+2=", "ü+ß="], "num_samples": 2,
                                       "sampling": sampling})
    assert json.loads(data) == {"command": "generate",
                                "kwargs": {"prompts": ["1+2=", "ü+ß="], "num_samples": 2,
                                           "sampling": sampling.to_json()}}
    assert decode_command(data) == ("generate", {"prompts": ["1+2=", "ü+ß="], "num_samples": 2,
                                                 "sampling": sampling.to_json()})
    assert decode_command(encode_command("shutdown", {})) == ("shutdown", {})


def test_completions_round_trip_through_the_pipe_format():
    groups = [[Completion(prompt_ids=(5, 6), token_ids=(7, 2), logprobs=(-0.1234567890123, -1e-9),
                          text="3", stopped=True),
               Completion(prompt_ids=(5, 6), token_ids=(8,), logprobs=(-2.5,), text="é",
                          stopped=False)],
              [Completion(prompt_ids=(4,), token_ids=(), logprobs=(), text="", stopped=False)]]
    value = decode_reply(encode_reply(completions_to_json(groups)), "generate")
    assert completions_from_json(value) == groups  # exact: floats survive JSON bit for bit
    assert decode_reply(encode_reply(None), "start") is None


def _refuse_weights():
    raise ValueError("the engine refused the weights")


def test_an_error_reply_carries_the_engine_traceback():
    try:
        _refuse_weights()
    except ValueError as error:
        data = encode_failure(error)
        traceback_text = "".join(traceback.format_exception(error))
    assert json.loads(data) == {"ok": False, "error": traceback_text}
    with pytest.raises(EngineError) as raised:
        decode_reply(data, "update_weights")
    assert str(raised.value) == f"the inference engine failed 'update_weights':\n{traceback_text}"
    assert traceback_text.startswith("Traceback (most recent call last):")
    assert "in _refuse_weights" in traceback_text
    assert traceback_text.endswith("ValueError: the engine refused the weights\n")


@pytest.mark.parametrize("data", [b"\x80not utf-8", b"{not json", b"[1, 2]", b'{"value": 1}'])
def test_a_malformed_reply_is_an_engine_error(data):
    with pytest.raises(EngineError) as raised:
        decode_reply(data, "generate")
    assert str(raised.value) == (f"the inference engine answered 'generate' with a malformed "
                                 f"message: {data!r}")


class _EchoSpec:
    """What :class:`EngineProcess` needs of a spec: a device name and a JSON form."""

    device = "cpu"

    def __init__(self, **fields) -> None:
        self._fields = fields

    def to_json(self) -> dict:
        return self._fields


class EchoServer:
    """A stand-in engine for the pipe: echoes, fails, returns what JSON cannot hold."""

    def __init__(self, spec_json: dict) -> None:
        if spec_json.get("fail_start"):
            raise RuntimeError("no engine for this spec")
        self.spec = spec_json

    def do_echo(self, **kwargs):
        return {"spec": self.spec, "kwargs": kwargs}

    def do_fail(self):
        _refuse_weights()

    def do_unserialisable(self):
        return {1, 2}

    def do_sleep(self, seconds):
        import time

        time.sleep(seconds)

    def do_start_holder(self):
        """A process that inherits every descriptor of this one (the pipe's end too) and
        outlives it; returns its pid."""
        import subprocess
        import sys

        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                  close_fds=False)
        return holder.pid

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_the_engine_process_answers_over_the_json_pipe():
    sampling = SamplingConfig(temperature=0.5)
    with EngineProcess(_EchoSpec(name="echo"), timeout_s=60.0, server=EchoServer) as engine:
        assert engine.call("echo", n=3, sampling=sampling) == {
            "spec": {"name": "echo"}, "kwargs": {"n": 3, "sampling": sampling.to_json()}}
        with pytest.raises(EngineError) as raised:
            engine.call("fail")
        message = str(raised.value)
        assert message.startswith("the inference engine failed 'fail':\nTraceback"), message
        assert "in do_fail" in message and "in _refuse_weights" in message
        assert message.endswith("ValueError: the engine refused the weights\n"), message
        with pytest.raises(EngineError) as raised:
            engine.call("unserialisable")
        assert str(raised.value).endswith(
            "TypeError: Object of type set is not JSON serializable\n"), str(raised.value)
        assert engine.call("echo") == {"spec": {"name": "echo"}, "kwargs": {}}  # still serving


@pytest.mark.slow
def test_an_engine_that_cannot_start_sends_its_traceback():
    with pytest.raises(EngineError) as raised:
        EngineProcess(_EchoSpec(fail_start=True), timeout_s=60.0, server=EchoServer)
    message = str(raised.value)
    assert message.startswith("the inference engine failed 'start':\nTraceback"), message
    assert message.endswith("RuntimeError: no engine for this spec\n"), message


def _killed(engine: EngineProcess, then: str) -> str:
    """The pattern of the error naming ``engine``'s SIGKILL, followed by ``then`` (a pattern)."""
    return rf"^the inference engine process \(pid {engine.pid}\) exited with code -9{then}$"


@pytest.mark.slow
def test_an_engine_killed_at_any_moment_is_reported_by_its_exit_code():
    import os
    import signal
    import time

    with EngineProcess(_EchoSpec(name="echo"), timeout_s=60.0, server=EchoServer) as engine:
        os.kill(engine.pid, signal.SIGKILL)  # not reaped yet: the next command finds it dead
        started = time.monotonic()
        with pytest.raises(EngineError, match=_killed(engine, "(; cannot run| during) 'echo'")):
            engine.call("echo")
        assert time.monotonic() - started < 5.0


@pytest.mark.slow
def test_an_engine_killed_mid_command_is_reported_though_a_process_it_started_holds_its_pipe():
    import os
    import signal
    import time

    with EngineProcess(_EchoSpec(name="echo"), timeout_s=60.0, server=EchoServer,
                       liveness_s=0.5) as engine:
        holder = engine.call("start_holder")  # the pipe never reads as closed
        try:
            engine.submit("sleep", seconds=60)
            os.kill(engine.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineError, match=_killed(engine, " during 'sleep'")):
                engine.wait("sleep")
            assert time.monotonic() - started < 5.0
        finally:
            os.kill(holder, signal.SIGKILL)


@pytest.mark.slow
def test_closing_an_engine_with_a_command_pending_kills_it_at_once():
    import time

    engine = EngineProcess(_EchoSpec(name="echo"), timeout_s=60.0, server=EchoServer)
    engine.submit("sleep", seconds=60)
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5.0
    assert engine.alive_problem() == f"the inference engine process (pid {engine.pid}) " \
                                     "exited with code -9"
