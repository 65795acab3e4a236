"""Fixtures shared by the test folders."""

import shutil
import tempfile

import pytest


@pytest.fixture
def ipc_dir():
    """A private directory for the colocated transport's sockets and shared-memory slots."""
    # Short parent path: Unix socket paths are limited to ~100 characters.
    path = tempfile.mkdtemp(prefix="rf", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
