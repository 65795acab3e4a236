"""A test launch that outlives its timeout fails with the stacks of its processes: what each one
was waiting for, not only that it hung."""

import re

import pytest

from tests.launch import run_torchrun

HANGING = '''\
import subprocess
import sys
import time


def wait_for_the_child():
    child = "import time\\ndef child_waits():\\n    time.sleep(600)\\nchild_waits()"
    subprocess.run([sys.executable, "-c", child])


def rank_waits():
    time.sleep(600)


if int(__import__("os").environ["RANK"]) == 0:
    wait_for_the_child()
rank_waits()
'''


@pytest.mark.timeout(120)
def test_a_launch_past_its_timeout_shows_every_process_stack(tmp_path):
    script = tmp_path / "hanging.py"
    script.write_text(HANGING)
    with pytest.raises(AssertionError) as failure:
        run_torchrun(script, nproc=2, timeout_s=20)
    message = str(failure.value)
    assert "did not finish within 20s" in message
    # Python's fault handler, one block per thread: rank 1, rank 0 waiting for its child,
    # the child, and the launcher itself.
    for function in ("rank_waits", "wait_for_the_child", "child_waits"):
        assert len(re.findall(rf", line \d+ in {function}\n", message)) == 1, message
    assert "torch/distributed/run.py" in message, message
