"""Fixtures shared by the test folders, and the test tiers.

Tiers are markers given by folder, so a new file is classified by where it lives:
``tests/dist`` -> ``dist`` (each test starts processes: torchrun jobs or forked ranks, 1-120 s),
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
    """A parent for the private IPC directory (sockets, shared-memory slots): short, since a
    Unix socket path has at most ~100 characters and a GPU names its socket by a 36-character
    UUID."""
    path = tempfile.mkdtemp(prefix="rf", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind(request):
    """A module that leaves torch.distributed's default group behind fails here, by name, instead
    of breaking whichever test next initialises one in this process."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.module.__name__} left torch.distributed's default process group "
                    "initialised", pytrace=False)
