"""Fixtures shared by the test folders, and the test tiers.

Tiers are markers given by folder, so a new file is classified by where it lives:
``tests/dist`` -> ``dist`` (each test starts processes: torchrun jobs or forked ranks, 1-120 s),
``tests/gpu`` -> ``gpu``. ``make test-fast`` runs neither; ``make test`` runs everything (GPU tests
skip themselves without GPUs). A test elsewhere that starts a heavy process marks itself ``slow``.

``make test`` runs the suite on two pytest-xdist workers, each taking whole modules (in the order
collected): a module's fixtures (a launch that several of its tests read) are made once, on one
worker, and modules that read the same session-scoped launch go to one worker together
(``_SHARED_LAUNCHES``).
"""

import shutil
import tempfile
from pathlib import Path

import pytest

_TIER_BY_FOLDER = {"dist": pytest.mark.dist, "gpu": pytest.mark.gpu}
_TESTS = Path(__file__).resolve().parent


# Modules that read a session-scoped launch of tests/dist/conftest.py -> the module whose worker
# runs them too (that launch is then made once).
_SHARED_LAUNCHES = {"tests/dist/test_moe_parity.py": "tests/dist/test_export_parity.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.resolve().relative_to(_TESTS).parts[0]
        if folder in _TIER_BY_FOLDER:
            item.add_marker(_TIER_BY_FOLDER[folder])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, a scope being a module or the modules that share a
    launch (``--dist loadgroup`` would do it with marks, but pytest-xdist 3.8 does not see its
    group marks under pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesSharingLaunches(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _SHARED_LAUNCHES.get(module, module)

    return ModulesSharingLaunches(config, log)


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
