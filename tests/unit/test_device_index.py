"""Which GPU each rank of a job takes on its node: the index maths for one and several nodes."""

import pytest

from mcore_refit.distributed import colocated_device_index
from mcore_refit.non_colocated import non_colocated_device_index


def split_layout(*, num_nodes: int, ranks_per_node: int, num_trainer_ranks: int,
                 num_gpus: int) -> list[list[int]]:
    """Per node, the GPU of each local rank, as torchrun numbers ranks (node-major)."""
    return [[non_colocated_device_index(rank=node * ranks_per_node + local,
                                    local_rank=local, local_world_size=ranks_per_node,
                                    num_trainer_ranks=num_trainer_ranks, num_gpus=num_gpus)
             for local in range(ranks_per_node)]
            for node in range(num_nodes)]


def test_two_nodes_of_eight_gpus_put_trainers_on_one_and_engines_on_the_other():
    # 8 trainer ranks on node 0, 8 inference ranks on node 1: the layout that used to raise
    # "need GPUs other than trainer rank 0's" by comparing global counts with local GPUs.
    assert split_layout(num_nodes=2, ranks_per_node=8, num_trainer_ranks=8,
                        num_gpus=8) == [list(range(8)), list(range(8))]


def test_two_nodes_of_eight_gpus_with_trainers_spilling_onto_the_second():
    # 12 trainer ranks + 4 inference ranks: node 1 holds trainer ranks 8..11 then inference.
    assert split_layout(num_nodes=2, ranks_per_node=8, num_trainer_ranks=12,
                        num_gpus=8) == [list(range(8)), list(range(8))]


def test_more_ranks_than_gpus_share_the_last_gpus_but_never_the_first_trainers():
    # One node, 2 GPUs: trainer ranks 0, 1 on GPUs 0, 1 and the inference rank beside trainer 1.
    assert split_layout(num_nodes=1, ranks_per_node=3, num_trainer_ranks=2,
                        num_gpus=2) == [[0, 1, 1]]
    # Node 0 (4 GPUs) holds trainer ranks 0-2; node 1 (2 GPUs) trainer ranks 3, 4 and the
    # inference rank, which shares the GPU of trainer rank 4, not that of its first trainer.
    assert [non_colocated_device_index(rank=rank, local_rank=rank, local_world_size=3,
                                   num_trainer_ranks=5, num_gpus=4)
            for rank in range(3)] == [0, 1, 2]
    assert [non_colocated_device_index(rank=3 + local, local_rank=local, local_world_size=3,
                                   num_trainer_ranks=5, num_gpus=2)
            for local in range(3)] == [0, 1, 1]


def test_a_node_of_trainers_and_engines_sharing_eight_gpus():
    # 2 nodes x 12 ranks on 8 GPUs each, 16 trainer ranks: node 0 has 12 trainers (too many).
    with pytest.raises(ValueError, match=r"^12 trainer ranks on this node but it has 8 GPUs: "
                                         r"launch at most one trainer rank per GPU$"):
        split_layout(num_nodes=2, ranks_per_node=12, num_trainer_ranks=16, num_gpus=8)


def test_inference_ranks_that_would_take_the_first_trainers_gpu_are_refused():
    with pytest.raises(ValueError, match=r"^2 inference ranks on this node need GPUs other than "
                                         r"its first trainer rank's, but this node has 2$"):
        non_colocated_device_index(rank=0, local_rank=0, local_world_size=3, num_trainer_ranks=1,
                               num_gpus=2)


def test_a_node_of_engines_only_needs_a_gpu_per_engine():
    with pytest.raises(ValueError, match=r"^3 inference ranks on this node but it has 2 GPUs: "
                                         r"launch at most one inference rank per GPU$"):
        non_colocated_device_index(rank=4, local_rank=1, local_world_size=3, num_trainer_ranks=3,
                               num_gpus=2)


def test_colocated_ranks_take_their_local_rank_on_every_node():
    assert [[colocated_device_index(local_rank=local, local_world_size=8, num_gpus=8)
             for local in range(8)] for _node in range(2)] == [list(range(8))] * 2
    with pytest.raises(ValueError, match=r"^9 ranks on this node but it has 8 GPUs: a colocated "
                                         r"job runs one trainer rank \(and its engine\) per GPU$"):
        colocated_device_index(local_rank=0, local_world_size=9, num_gpus=8)


def test_a_local_rank_outside_the_node_is_refused():
    with pytest.raises(ValueError, match=r"^local rank 8 is outside this node's 8 ranks$"):
        colocated_device_index(local_rank=8, local_world_size=8, num_gpus=8)
    with pytest.raises(ValueError, match=r"^local rank 3 is outside this node's 2 ranks$"):
        non_colocated_device_index(rank=3, local_rank=3, local_world_size=2, num_trainer_ranks=1,
                               num_gpus=2)
