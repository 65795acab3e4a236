"""A user's function that never returns is reported, naming the rank, the function and its
input, within run.callback_timeout_s (60 s by default)."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mcore_refit.config import from_dict
from mcore_refit.grpo.callbacks import CallbackWatchdog
from mcore_refit.grpo.config import GRPOJobConfig, RunConfig
from mcore_refit.grpo.tasks import Problem

REPO_ROOT = Path(__file__).resolve().parents[2]
NAME = "the reward function task.reward='my_pkg.rewards:score'"


def test_a_hanging_callback_is_reported_within_a_minute_by_default():
    assert RunConfig().callback_timeout_s == 60.0
    assert RunConfig(callback_timeout_s=None).callback_timeout_s is None
    with pytest.raises(ValueError) as raised:
        from_dict(GRPOJobConfig, {"model": {"hf_path": "/c"}, "run": {"callback_timeout_s": 0}})
    assert str(raised.value) == "run.callback_timeout_s must be > 0 or null, got 0.0"


def test_a_call_that_overruns_is_named_with_its_rank_and_input():
    released = threading.Event()
    reports = []

    def on_timeout(message):
        reports.append((time.monotonic(), message))
        released.set()

    def hangs(problem, completion):
        released.wait(30)
        return 1.0

    watchdog = CallbackWatchdog(timeout_s=0.4, where="trainer rank 1", on_timeout=on_timeout)
    reward = watchdog.bound(hangs, name=NAME)
    started = time.monotonic()
    assert reward(Problem(prompt="1+1=", answer="2"), "2") == 1.0
    ((reported, message),) = reports
    assert 0.4 <= reported - started < 1.5
    assert message == (f"trainer rank 1: {NAME} did not return within 0.4 s "
                       "(run.callback_timeout_s), called with (Problem(prompt='1+1=', "
                       "answer='2', record={}), '2'); this rank exits")


def test_calls_that_return_in_time_are_never_reported():
    reports = []
    watchdog = CallbackWatchdog(timeout_s=0.2, where="trainer rank 0", on_timeout=reports.append)
    reward = watchdog.bound(lambda problem, completion: 0.5, name=NAME)
    for _ in range(1000):
        reward(None, "x")
    time.sleep(0.6)  # idle between calls: nothing runs, nothing overruns
    assert reward(None, "x") == 0.5 and reports == []
    assert CallbackWatchdog(timeout_s=None, where="x").bound(len, name="len") is len


def test_by_default_the_rank_exits_with_one_line_naming_the_call(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from mcore_refit.grpo.callbacks import CallbackWatchdog

        def score(problem, completion):
            time.sleep(60)

        watchdog = CallbackWatchdog(timeout_s=0.5, where="trainer rank 1")
        watchdog.bound(score, name={NAME!r})("2+2=", "4")
    """))
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 1
    assert time.monotonic() - started < 20  # the interpreter's start on a loaded machine
    assert result.stderr == (f"CallbackTimeout: trainer rank 1: {NAME} did not return within "
                             "0.5 s (run.callback_timeout_s), called with ('2+2=', '4'); this "
                             "rank exits\n")
