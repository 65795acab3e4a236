"""I/O errors that name the path and the cause (issue 24, point 4): a full device, on a real
tmpfs where this machine lets root mount one, else an injected ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import subprocess

import pytest

from mcore_refit.config import load_config
from mcore_refit.files import replace_text, writing
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.metrics import MetricsWriter
from tests.launch import REPO_ROOT

CONFIG = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"


@pytest.fixture
def full_disk(request, tmp_path, monkeypatch):
    """(a directory, fill()): fill() leaves its device with no free byte. A 1 MiB tmpfs (where
    root may mount one); or every write under the directory raises ENOSPC once fill() ran."""
    disk = tmp_path / "disk"
    disk.mkdir()
    kind = getattr(request, "param", "tmpfs")
    mounted = kind == "tmpfs" and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
        capture_output=True).returncode == 0
    if kind == "tmpfs" and not mounted:
        pytest.skip("this machine does not allow mounting a tmpfs")
    if mounted:
        def fill():
            with pytest.raises(OSError) as error:
                with (disk / "filler").open("wb") as file:
                    while True:
                        file.write(b"\0" * 65536)
                        file.flush()
            assert error.value.errno == errno.ENOSPC
    else:
        import builtins
        import io

        real_open = io.open

        def fill():
            def full_open(path, mode="r", *args, **kwargs):
                if str(path).startswith(str(disk)) and any(c in mode for c in "wax+"):
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
                return real_open(path, mode, *args, **kwargs)
            monkeypatch.setattr(builtins, "open", full_open)
            monkeypatch.setattr(io, "open", full_open)
    try:
        yield disk, fill
    finally:
        if mounted:  # lazily: a file a failed test left open must not keep it mounted
            subprocess.run(["umount", "--lazy", str(disk)], check=False)


@pytest.mark.parametrize("full_disk", ["tmpfs", "injected"], indirect=True)
def test_a_full_device_is_named_with_the_path_being_written(full_disk):
    disk, fill = full_disk
    state = disk / "trainer_state.json"
    replace_text(state, '{"step": 2}')
    fill()
    with pytest.raises(OSError) as error:
        replace_text(state, '{"step": 4, "checkpoint": "checkpoints/step_000004"}' * 1000)
    assert error.value.errno == errno.ENOSPC
    assert str(error.value) == f"[Errno 28] no space left on device writing {state}"
    assert state.read_text() == '{"step": 2}'  # the previous state stays whole
    assert not (disk / "trainer_state.json.tmp").exists()


def test_an_error_hiding_a_full_device_is_named_as_one(full_disk):
    disk, fill = full_disk
    fill()
    with pytest.raises(OSError, match=rf"no space left on device writing {disk}/common.pt$"):
        with writing(disk / "common.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 704 "
                               "vs 598")
    with pytest.raises(OSError, match=rf"^\[Errno 13\] Permission denied writing {disk}/x$"):
        with writing(disk / "x"):
            raise OSError(errno.EACCES, "Permission denied")


def test_metrics_rows_on_a_full_device_name_the_file(full_disk):
    disk, fill = full_disk
    config = load_config(GRPOJobConfig, CONFIG, [f"run.output_dir={disk}",
                                                 "run.tensorboard=false"])
    writer = MetricsWriter(config, enabled=True)
    fill()
    with pytest.raises(OSError) as error:
        for step in range(1, 10000):  # past any buffer
            writer.log({"step": step, "reward_mean": 0.5, "note": "x" * 4096})
    with contextlib.suppress(OSError):
        writer.close()
    assert str(error.value) == f"[Errno 28] no space left on device writing {disk}/metrics.jsonl"
