"""Each GPU's memory, estimated from the config and checked before a launch starts (issue 25,
item 5): the benchmark's and the GRPO job's."""

import pytest

from mcore_refit.bench.config import RefitBenchJob
from mcore_refit.bench.memory import bench_needs, check_bench_memory
from mcore_refit.bench.sources import preset_config
from mcore_refit.config import ParallelConfig, load_config
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.job import validate_launch
from mcore_refit.grpo.memory import check_grpo_memory
from mcore_refit.memory import GIB, InsufficientGpuMemory, ModelTensors
from tests.launch import REPO_ROOT

H200 = int(139.8 * GIB)  # torch's total_memory of an H200
H100 = int(79.1 * GIB)


@pytest.fixture(scope="module")
def moe_48():
    return ModelTensors.from_hf_config(preset_config("qwen3_30b_a3b"))


@pytest.fixture(scope="module")
def llama_8b():
    return ModelTensors.from_hf_config(preset_config("llama3_8b"))


def bench(*overrides) -> RefitBenchJob:
    return load_config(RefitBenchJob, REPO_ROOT / "configs" / "refit_bench.yaml",
                       ["bench.source=megatron", *overrides])


def test_model_tensors_split_over_stages_experts_and_tensor_ranks(moe_48, llama_8b):
    assert llama_8b.numel * 2 == 16_060_522_496  # the 8B preset's 16.06 GB in bf16
    assert moe_48.numel * 2 == 61_064_245_248  # the 48-layer MoE preset's 61.1 GB
    pp2_vpp2 = ParallelConfig(pipeline=2, virtual_pipeline=2)
    assert sum(llama_8b.stage_numel(pp2_vpp2, stage) for stage in range(2)) == llama_8b.numel
    experts = sum(t.numel for t in moe_48.tensors if t.expert)
    assert moe_48.stage_numel(ParallelConfig(expert=2), 0) == moe_48.numel - experts // 2
    vectors = sum(t.numel for t in llama_8b.tensors if not t.matrix)
    assert llama_8b.stage_numel(ParallelConfig(tensor=2), 0) == \
        (llama_8b.numel - vectors) // 2 + vectors


def test_the_48_layer_moe_at_ep2_beside_trainer_rank_1_is_refused(moe_48):
    """DESIGN.md §7: on 2 H200s the engine beside trainer rank 1 ran out of memory in
    transport_alone (73 GiB trainer + 66.8 GiB engine of 139.8)."""
    job = bench("bench.num_trainer_ranks=2", "megatron.preset=qwen3_30b_a3b",
                "megatron.parallel.expert=2", "bench.modes=[raw_link,engine,transport_alone]")
    with pytest.raises(InsufficientGpuMemory) as error:
        check_bench_memory(job, world_size=3, num_gpus=2, capacity_of=lambda gpu: H200,
                           tensors=moe_48)
    assert str(error.value) == (
        "GPU 1 cannot hold trainer rank 1 and inference rank 0: they need 141.6 GiB, the GPU "
        "has 139.8 GiB (trainer rank 1: 71.7 GiB = weights 29.9 + refit slots 2.0 + "
        "transport_alone's captured copy 29.9 + process overhead 10.0; inference rank 0: "
        "69.9 GiB = the engine's copy of the model 56.9 + refit slots 2.0 + raw link buffer "
        "1.0 + process overhead 10.0). Use more GPUs, fewer layers (megatron.num_layers), or "
        "drop the mode that needs the extra copy")
    # Without the captured copy it fits; so does the copy with 24 layers, or on its own GPUs.
    without = bench("bench.num_trainer_ranks=2", "megatron.preset=qwen3_30b_a3b",
                    "megatron.parallel.expert=2", "bench.modes=[raw_link,engine]")
    check_bench_memory(without, world_size=3, num_gpus=2, capacity_of=lambda gpu: H200,
                       tensors=moe_48)
    check_bench_memory(job, world_size=4, num_gpus=4, capacity_of=lambda gpu: H200,
                       tensors=moe_48)
    half = bench("bench.num_trainer_ranks=2", "megatron.preset=qwen3_30b_a3b",
                 "megatron.num_layers=24", "megatron.parallel.expert=2",
                 "bench.modes=[raw_link,engine,transport_alone]")
    check_bench_memory(half, world_size=3, num_gpus=2, capacity_of=lambda gpu: H200)


@pytest.mark.parametrize(("overrides", "world_size", "num_gpus", "capacity"), [
    ([], 2, 2, H100),  # 1 -> 1, TP1
    (["bench.num_trainer_ranks=2", "megatron.parallel.pipeline=2"], 3, 2, H100),  # beside rank 1
    (["bench.num_trainer_ranks=2", "megatron.parallel.pipeline=2",
      "megatron.parallel.virtual_pipeline=2"], 4, 4, H200),  # 2 -> 2
    (["bench.num_trainer_ranks=2", "megatron.parallel.tensor=2"], 4, 4, H200),
    ([], 4, 4, H200),  # 1 -> 3
    (["refit.mode=colocated", "bench.num_trainer_ranks=4", "megatron.parallel.tensor=2",
      "megatron.parallel.pipeline=2", "megatron.parallel.virtual_pipeline=2"], 4, 4, H200),
])
def test_the_8b_layouts_fit(llama_8b, overrides, world_size, num_gpus, capacity):
    modes = "bench.modes=[raw_link,engine,transport_alone]"
    job = bench(*overrides, modes)
    check_bench_memory(job, world_size=world_size, num_gpus=num_gpus,
                       capacity_of=lambda gpu: capacity, tensors=llama_8b)
    needs = bench_needs(job, world_size=world_size, num_gpus=num_gpus,
                        capacity_of=lambda gpu: capacity, tensors=llama_8b)
    assert len(needs) == num_gpus


def test_a_grpo_launch_that_cannot_fit_is_refused_before_the_start_up(tmp_path):
    """An 8B Llama in fp32 trained colocated at PP2 x VPP2: Adam's state, fp32 gradients and
    the engine's fp32 copy need more than an H100, less than an H200."""
    preset_config("llama3_8b").save_pretrained(tmp_path)
    config = load_config(GRPOJobConfig, REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml",
                         [f"model.hf_path={tmp_path}", f"run.output_dir={tmp_path / 'run'}"])
    check_grpo_memory(config, world_size=2, local_world_size=2, num_gpus=2,
                      capacity_of=lambda gpu: H200)
    with pytest.raises(InsufficientGpuMemory) as error:
        validate_launch(config, world_size=2, resume=False, num_gpus=2,
                        capacity_of=lambda gpu: H100)
    assert str(error.value).startswith(
        "GPU 0 cannot hold trainer rank 0 and trainer rank 0's engine: they need 111.7 GiB, the "
        "GPU has 79.1 GiB (trainer rank 0: 71.8 GiB = weights 15.0 + gradients (fp32) 15.0 + "
        "Adam state 29.9 + refit slots 2.0 + process overhead 10.0; trainer rank 0's engine: "
        "39.9 GiB = the engine's copy of the model 29.9 + process overhead 10.0); GPU 1 cannot "
        "hold trainer rank 1 and trainer rank 1's engine")
    assert str(error.value).endswith(
        ". Use more GPUs (more pipeline, tensor or expert parallelism), "
        "policy.optimizer.use_distributed_optimizer, or a smaller model")
    assert not (tmp_path / "run").exists()  # refused before the run directory was claimed


def test_a_vllm_engine_counts_its_staging_reference_model_and_kv_cache(llama_8b, tmp_path):
    """The 8B preset refitted into vLLM colocated (benchmarks/refit_vllm.sh): the engine holds the
    model three times while verifying, which an H100 cannot hold beside the trainer."""
    modes = "bench.modes=[engine,transport_alone,vllm_load_floor]"
    colocated = bench("refit.mode=colocated", "bench.engine=vllm", modes)
    with pytest.raises(InsufficientGpuMemory) as error:
        check_bench_memory(colocated, world_size=1, num_gpus=1, capacity_of=lambda gpu: H100,
                           tensors=llama_8b)
    assert str(error.value) == (
        "GPU 0 cannot hold trainer rank 0 and trainer rank 0's engine: they need 97.0 GiB, the "
        "GPU has 79.1 GiB (trainer rank 0: 41.9 GiB = weights 15.0 + refit slots 2.0 + "
        "transport_alone's captured copy 15.0 + process overhead 10.0; trainer rank 0's engine: "
        "55.1 GiB = the engine's copy of the model 15.0 + vLLM's refit staging 15.0 + vLLM's "
        "reference model (verify) 15.0 + vLLM's KV cache 0.2 + process overhead 10.0). Use more "
        "GPUs, fewer layers (megatron.num_layers), or drop the mode that needs the extra copy")
    check_bench_memory(colocated, world_size=1, num_gpus=1, capacity_of=lambda gpu: H200,
                       tensors=llama_8b)
    check_bench_memory(bench("bench.engine=vllm", modes), world_size=2, num_gpus=2,
                       capacity_of=lambda gpu: H100, tensors=llama_8b)
    # The GRPO job (PP2, two ranks): verified refits into vLLM, whose KV cache fills what is left
    # of gpu_memory_utilization (0.3 x 139.8 GiB - the 15.0 GiB model).
    preset_config("llama3_8b").save_pretrained(tmp_path)
    config = load_config(GRPOJobConfig, REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml",
                         [f"model.hf_path={tmp_path}", "model.dtype=bfloat16",
                          "inference.dtype=bfloat16", "inference.engine=vllm",
                          "inference.vllm.kv_cache_bytes=null",
                          "inference.vllm.gpu_memory_utilization=0.3", "run.verify_refit=true",
                          f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(InsufficientGpuMemory) as error:
        check_grpo_memory(config, world_size=2, local_world_size=2, num_gpus=2,
                          capacity_of=lambda gpu: H200)
    assert ("trainer rank 0's engine: 81.9 GiB = the engine's copy of the model 15.0 + vLLM's "
            "refit staging 15.0 + vLLM's reference model (verify) 15.0 + vLLM's KV cache 27.0 "
            "+ process overhead 10.0") in str(error.value)
