"""How a rank's process groups are torn down, after success and after a failure."""

import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from mcore_refit import distributed


@pytest.fixture
def torn_down(monkeypatch):
    """The teardown calls (``.calls``) of a job whose default group has the backend ``.backend``,
    without starting any group."""
    job = SimpleNamespace(backend="gloo", calls=[])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: job.backend)
    monkeypatch.setattr(dist, "destroy_process_group",
                        lambda group=None: job.calls.append("destroy"))
    monkeypatch.setattr(distributed, "destroy_model_parallel",
                        lambda: job.calls.append("megatron"))
    return job


def test_after_a_failure_nccl_communicators_are_left_to_the_exit(torn_down):
    torn_down.backend = "nccl"
    distributed.shutdown()
    assert torn_down.calls == ["megatron", "destroy"]
    torn_down.calls.clear()
    # A destroy waits on the peers and kernels of each communicator (forever, where a peer died
    # mid-collective): a failed rank, on its way out, does not.
    distributed.shutdown(failed=True)
    assert torn_down.calls == ["megatron"]
    torn_down.backend = "gloo"
    distributed.shutdown(failed=True)
    assert torn_down.calls == ["megatron", "megatron", "destroy"]


def test_errors_of_the_teardown_after_a_failure_are_logged_not_raised(torn_down, monkeypatch,
                                                                       caplog):
    def broken(group=None):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "destroy_process_group", broken)
    distributed.shutdown(failed=True)
    assert "tearing down the process groups after a failure" in caplog.text
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        distributed.shutdown()


def test_megatron_is_not_imported_to_tear_down_groups_it_never_made(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    distributed.destroy_model_parallel()
    assert "megatron.core.parallel_state" not in sys.modules
