"""LoadPipeline: vLLM's loads on a thread of their own, in arrival order, failures surfaced."""

import sys
import threading
import time

import pytest
import torch

from mcore_refit.inference.vllm.pipeline import SWITCH_INTERVAL_S, LoadPipeline

CPU = torch.device("cpu")


def test_vllm_pipeline_loads_in_order_off_the_callers_thread_and_drain_waits_for_all():
    release = threading.Event()
    loaded, threads = [], set()

    def load(weights):
        release.wait(10)  # held until the caller has submitted everything
        threads.add(threading.get_ident())
        loaded.extend(name for name, _ in weights)

    pipeline = LoadPipeline(load, device=CPU)
    try:
        for index in range(5):
            pipeline.submit([(f"w{index}a", torch.ones(1)), (f"w{index}b", torch.ones(1))])
        assert loaded == [] and pipeline.busy  # submit returned before any load ran
        release.set()
        pipeline.drain(timeout_s=10)
        assert loaded == [f"w{i}{p}" for i in range(5) for p in "ab"]
        assert threads and threading.get_ident() not in threads
        assert not pipeline.busy and pipeline.load_s > 0
    finally:
        pipeline.close()


def test_vllm_pipeline_merges_the_loads_queued_behind_a_busy_thread_into_one_call():
    """Buffers that arrive while vLLM is still loading go to its loader together: one call's
    fixed cost instead of one per buffer. A step queued between loads is not merged over."""
    release = threading.Event()
    calls = []
    pipeline = LoadPipeline(lambda weights: calls.append([name for name, _ in weights]),
                            device=CPU)
    try:
        pipeline.run(lambda: release.wait(10), what="holding the thread")
        for index in range(4):
            pipeline.submit([(f"w{index}a", torch.ones(1)), (f"w{index}b", torch.ones(1))])
        pipeline.run(lambda: calls.append("step"), what="a step between loads")
        pipeline.submit([("w4a", torch.ones(1))])
        release.set()
        pipeline.drain(timeout_s=10)
        assert calls == [[f"w{i}{p}" for i in range(4) for p in "ab"], "step", ["w4a"]]
        assert pipeline.load_calls == 2
        pipeline.reset_timing()
        assert pipeline.load_calls == 0 and pipeline.load_s == 0 and pipeline.load_cpu_s == 0
    finally:
        pipeline.close()


def test_a_load_that_waits_counts_wall_time_but_not_cpu_time():
    """``load_cpu_s`` is the loading thread's CPU time: a refit's loads that took longer than
    the floor's for the same tensors show whether they did more work or waited."""
    pipeline = LoadPipeline(lambda weights: time.sleep(0.2), device=CPU)
    try:
        pipeline.submit([("w", torch.ones(1))])
        pipeline.drain(timeout_s=10)
        assert pipeline.load_s >= 0.2 and pipeline.load_cpu_s < 0.1
    finally:
        pipeline.close()


def test_vllm_pipeline_failure_skips_later_loads_and_is_raised_naming_the_tensors():
    release = threading.Event()
    loaded = []

    def load(weights):
        if weights[0][0] == "bad":
            raise ValueError("shape mismatch")
        loaded.extend(name for name, _ in weights)

    pipeline = LoadPipeline(load, device=CPU)
    try:
        pipeline.submit([("a", torch.ones(1))])
        pipeline.drain(timeout_s=10)
        pipeline.run(lambda: release.wait(10), what="holding the thread")
        pipeline.submit([("bad", torch.ones(1))])
        pipeline.submit([("worse", torch.ones(1))])  # merged with 'bad' into one call
        pipeline.run(lambda: loaded.append("step"), what="a step")
        pipeline.submit([("c", torch.ones(1))])
        release.set()
        with pytest.raises(RuntimeError, match=r"vLLM's loader failed on the tensors 'bad' .. "
                                               r"'worse' \(ValueError: shape mismatch\)"):
            pipeline.drain(timeout_s=10)
        assert loaded == ["a"]  # the step and 'c' came after the failure: skipped
        pipeline.submit([("bad", torch.ones(1))])
        deadline = time.monotonic() + 10
        while pipeline.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="failed on the tensors 'bad' .. 'bad'"):
            pipeline.submit([("e", torch.ones(1))])  # raised by the next hand-over
        pipeline.drain(timeout_s=10)  # raised once: nothing left to raise
        pipeline.submit([("d", torch.ones(1))])  # the next refit loads again
        pipeline.drain(timeout_s=10)
        assert loaded == ["a", "d"]
    finally:
        pipeline.close()


def test_vllm_pipeline_drain_is_bounded_and_names_what_is_still_running():
    release = threading.Event()
    pipeline = LoadPipeline(lambda weights: None, device=CPU)
    try:
        pipeline.run(lambda: release.wait(10), what="holding the thread")
        pipeline.submit([("a", torch.ones(1))])
        pipeline.submit([("b", torch.ones(1))])
        with pytest.raises(TimeoutError, match=r"had not finished the refit's last buffers 0 s "
                                               r"after they arrived \(2 more queued behind the "
                                               r"one running\)"):
            pipeline.drain(timeout_s=0.05)
        assert pipeline.busy
    finally:
        release.set()
        pipeline.close()
    assert not pipeline.busy


def test_vllm_pipeline_runs_other_steps_in_order_with_the_loads_and_names_their_failure():
    """A refit's set-up of vLLM's reload runs on the loading thread before its loads; if it
    fails, the loads queued behind it are skipped and the failure names the step."""
    release = threading.Event()
    done = []

    def set_up(fail: bool):
        release.wait(10)
        if fail:
            raise KeyError("layer 3")
        done.append(("set up", threading.get_ident()))

    pipeline = LoadPipeline(lambda weights: done.append(weights[0][0]), device=CPU)
    try:
        pipeline.run(lambda: set_up(False), what="setting up the reload")
        pipeline.submit([("a", torch.ones(1))])
        assert done == [] and pipeline.busy  # run() returned before the step ran
        release.set()
        pipeline.drain(timeout_s=10)
        assert done[0][0] == "set up" and done[0][1] != threading.get_ident()
        assert done[1:] == ["a"]
        release.clear()  # 'b' is queued before the set-up fails
        pipeline.run(lambda: set_up(True), what="setting up the reload")
        pipeline.submit([("b", torch.ones(1))])
        release.set()
        with pytest.raises(RuntimeError, match=r"vLLM's loader failed setting up the reload "
                                               r"\(KeyError: 'layer 3'\)"):
            pipeline.drain(timeout_s=10)
        assert done[1:] == ["a"]  # 'b' came after the failed set-up: skipped
    finally:
        pipeline.close()


def test_vllm_pipeline_shortens_the_switch_interval_while_loads_run_and_restores_it():
    """vLLM's Python-heavy loads hold the GIL; the receiving thread gets it back within the
    shortened interval while they run, and the process's own interval returns after."""
    release = threading.Event()
    seen = []
    before = sys.getswitchinterval()
    pipeline = LoadPipeline(lambda weights: seen.append(sys.getswitchinterval()), device=CPU)
    try:
        pipeline.run(lambda: release.wait(10), what="holding the thread")
        pipeline.submit([("a", torch.ones(1))])
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S < before
        release.set()
        pipeline.drain(timeout_s=10)
        assert seen == [SWITCH_INTERVAL_S] and sys.getswitchinterval() == before
        pipeline.submit([("b", torch.ones(1))])
        pipeline.close()  # closing without a drain restores it too
        assert sys.getswitchinterval() == before
    finally:
        release.set()
        pipeline.close()
