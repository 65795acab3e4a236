"""The routes of the fan-outs over links (pure): which links a placement needs for the relay
and the direct fan-out, each relayed buffer's entry."""

import torch

from mcore_refit.refit import Placement
from mcore_refit.refit.plan import TensorSpec, build_plan
from mcore_refit.refit.transports.non_colocated.fanout import entries


def test_relay_links_join_each_source_to_its_remote_engines_and_those_to_each_other():
    two_to_two = Placement(num_trainers=2, num_receivers=2)
    assert two_to_two.relay_links() == [(0, 2), (0, 3), (2, 3), (3, 2), (1, 2), (1, 3)]
    one_to_three = Placement(num_trainers=1, num_receivers=3)
    assert one_to_three.relay_links() == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 1),
                                          (2, 3), (3, 1), (3, 2)]
    # Trainer rank 1 shares inference rank 0's device (IPC): it relays only to inference rank 1.
    shared = Placement(num_trainers=2, num_receivers=2, shared=frozenset({(1, 0)}))
    assert shared.relay_links() == [(0, 2), (0, 3), (2, 3), (3, 2), (1, 3)]


def test_direct_links_join_each_source_to_its_remote_engines_only():
    assert Placement(num_trainers=2, num_receivers=2).direct_links() == [(0, 2), (0, 3),
                                                                           (1, 2), (1, 3)]
    assert Placement(num_trainers=1, num_receivers=3).direct_links() == [(0, 1), (0, 2), (0, 3)]
    # Trainer rank 1 shares inference rank 0's device (IPC): it needs a link to inference rank 1.
    shared = Placement(num_trainers=2, num_receivers=2, shared=frozenset({(1, 0)}))
    assert shared.direct_links() == [(0, 2), (0, 3), (1, 3)]
    # A job built for the relay can run the direct fan-out.
    for placement in (shared, Placement(num_trainers=3, num_receivers=2)):
        assert set(placement.direct_links()) <= set(placement.relay_links())


def test_each_sources_buffers_take_its_remote_engines_in_turn_from_its_own_offset():
    specs = [TensorSpec(f"t{i}", (64,), torch.float32) for i in range(8)]
    plan = build_plan(specs, sources=[i % 2 for i in range(8)], slot_bytes=512, num_slots=2)
    sources = [b.source for b in plan.buffers]
    assert sources == [0, 1] * (len(sources) // 2)
    routes = entries(plan, Placement(num_trainers=2, num_receivers=2))
    assert routes[0::2] == [0, 1] * (len(routes) // 4)  # source 0 starts at engine 0
    assert routes[1::2] == [1, 0] * (len(routes) // 4)  # source 1 at engine 1
    shared = entries(plan, Placement(num_trainers=2, num_receivers=2,
                                     shared=frozenset({(1, 0)})))
    assert set(shared[1::2]) == {1}  # source 1's only remote engine
