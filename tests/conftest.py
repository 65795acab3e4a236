"""Fixtures shared by the test folders, and the test tiers.

Tiers are markers given by folder, so a new file is classified by where it lives:
``tests/dist`` -> ``dist`` (each test starts processes: torchrun jobs or spawned ranks, 10-120 s),
``tests/gpu`` -> ``gpu``. ``make test-fast`` runs neither; ``make test`` runs everything (GPU tests
skip themselves without GPUs). A test elsewhere that starts a heavy process marks itself ``slow``.
"""

import shutil
import tempfile
from pathlib import Path

import pytest

_TIER_BY_FOLDER = {"dist": pytest.mark.dist, "gpu": pytest.mark.gpu}
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.resolve().relative_to(_TESTS).parts[0]
        if folder in _TIER_BY_FOLDER:
            item.add_marker(_TIER_BY_FOLDER[folder])


@pytest.fixture
def ipc_dir():
    """A private directory for the colocated transport's sockets and shared-memory slots."""
    # Short parent path: Unix socket paths are limited to ~100 characters.
    path = tempfile.mkdtemp(prefix="rf", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
