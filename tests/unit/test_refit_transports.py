"""The transport registry: names to sender and receiver classes, chosen by placement."""

import pytest

from mcore_refit.refit import (
    ColocatedReceiver,
    ColocatedSender,
    NonColocatedReceiver,
    NonColocatedSender,
    SharedWeightsSender,
    TransportOptions,
    receiver_class,
    register_transport,
    sender_class,
    transport_for,
    transport_names,
)
from mcore_refit.refit.transports import _TRANSPORTS


@pytest.mark.parametrize("mode, sharing, name, sender, receiver", [
    ("colocated", "buffers", "colocated", ColocatedSender, ColocatedReceiver),
    ("colocated", "weights", "colocated_weights", SharedWeightsSender, ColocatedReceiver),
    ("non_colocated", "buffers", "non_colocated", NonColocatedSender, NonColocatedReceiver),
])
def test_each_placement_has_its_transport(mode, sharing, name, sender, receiver):
    assert transport_for(mode, TransportOptions(ipc_sharing=sharing)) == name
    assert sender_class(name) is sender and receiver_class(name) is receiver
    # Telemetry and init info carry the same name.
    assert sender.transport_name == name


def test_an_unknown_transport_lists_the_choices():
    with pytest.raises(ValueError) as error:
        sender_class("nccl")
    assert str(error.value) == ("unknown refit transport 'nccl'; choose one of 'colocated', "
                                "'colocated_weights', 'non_colocated'")
    with pytest.raises(ValueError, match="unknown refit mode 'split'"):
        transport_for("split", TransportOptions())


def test_a_registered_transport_is_imported_when_chosen():
    register_transport("test_backend", sender="collections:OrderedDict",
                       receiver="collections:Counter")
    try:
        assert "test_backend" in transport_names()
        import collections
        assert sender_class("test_backend") is collections.OrderedDict
        with pytest.raises(ValueError, match="'test_backend' is already registered"):
            register_transport("test_backend", sender="a:B", receiver="a:B")
        with pytest.raises(ValueError, match="must be 'module.path:ClassName', got 'a.B'"):
            register_transport("other", sender="a.B", receiver="a:B")
    finally:
        _TRANSPORTS.pop("test_backend", None)
