"""Launch multi-process scenarios under torchrun from tests, with a free port and a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: str | Path, *args: str, nproc: int, timeout_s: float,
                 env: dict[str, str] | None = None,
                 expect_failure: bool = False) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun with ``nproc`` ranks; raise with its output on failure
    (with ``expect_failure``, when it succeeds instead)."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(script), *args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, env=full_env, capture_output=True,
                                text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(
            f"{' '.join(command)} did not finish within {timeout_s}s\n"
            f"--- stdout ---\n{error.stdout}\n--- stderr ---\n{error.stderr}"
        ) from error
    if (result.returncode != 0) != expect_failure:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-10000:]}\n--- stderr ---\n{result.stderr[-10000:]}"
        )
    return result


def last_json_line(stdout: str) -> dict:
    """The JSON object on the last non-empty line of ``stdout``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise AssertionError("no output")
    return json.loads(lines[-1])
