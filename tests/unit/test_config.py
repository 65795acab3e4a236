"""Config loading and layout validation: every bad input gets an error that names it."""

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mcore_refit.bench.config import RefitBenchJob
from mcore_refit.compat import te_available
from mcore_refit.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    from_dict,
    load_config,
    load_section,
)
from mcore_refit.grpo.config import GRPOJobConfig, InferenceConfig, TaskConfig
from mcore_refit.grpo.run_config import RunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    learning_rates: list[float] = field(default_factory=list)


def test_load_yaml_with_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  hf_path: /ckpt\n  dtype: bfloat16\nparallel:\n  pipeline: 2\n")
    config = load_config(JobConfig, path, ["parallel.virtual_pipeline=2", "seed=7",
                                           "learning_rates=[1, 0.5]"])
    assert config.model == ModelConfig(hf_path="/ckpt", dtype="bfloat16")
    assert config.parallel == ParallelConfig(pipeline=2, virtual_pipeline=2)
    assert config.seed == 7
    assert config.learning_rates == [1.0, 0.5]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1


@pytest.mark.parametrize("data, message", [
    ({"model": {"hf_path": "/c"}, "parallell": {}},
     "unknown config key 'parallell' (known keys: learning_rates, model, parallel, seed)"),
    ({"model": {"hf_path": "/c", "dtyp": "float32"}},
     "unknown config key 'model.dtyp' (known keys: allow_hub, dtype, hf_path, layer_spec, "
     "load_weights, moe_aux_loss_coeff)"),
    ({}, "missing required config key 'model'"),
    ({"model": {}}, "missing required config key 'model.hf_path'"),
    ({"model": {"hf_path": "/c", "dtype": "fp8"}},
     "config key 'model.dtype' must be one of 'float32', 'bfloat16', 'float16', got 'fp8'"),
    ({"model": {"hf_path": "/c"}, "parallel": {"tensor": "2"}},
     "config key 'parallel.tensor' must be an integer, got '2'"),
    ({"model": {"hf_path": "/c"}, "parallel": {"tensor": True}},
     "config key 'parallel.tensor' must be an integer, got True"),
    ({"model": {"hf_path": "/c"}, "parallel": {"pipeline": 0}},
     "parallel.pipeline must be a positive integer, got 0"),
    ({"model": {"hf_path": "/c"}, "parallel": {"virtual_pipeline": 2}},
     "parallel.virtual_pipeline=2 needs parallel.pipeline > 1; "
     "set parallel.virtual_pipeline: null or raise parallel.pipeline"),
    ({"model": {"hf_path": "/c"}, "parallel": {"sequence_parallel": True}},
     "parallel.sequence_parallel=true needs parallel.tensor > 1; "
     "set parallel.sequence_parallel: false"),
    ({"model": {"hf_path": "/c", "load_weights": "yes"}},
     "config key 'model.load_weights' must be true or false, got 'yes'"),
    ({"model": {"hf_path": "/c"}, "seed": None}, "config key 'seed' must be an integer, got None"),
    ({"model": {"hf_path": "/c"}, "learning_rates": ["a"]},
     "config key 'learning_rates[0]' must be a number, got 'a'"),
    ({"model": "/c"}, "model must be a mapping, got str: '/c'"),
])
def test_bad_config_names_the_key(data, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_dict(JobConfig, data)


def test_bad_override_and_bad_file(tmp_path):
    with pytest.raises(ValueError, match=re.escape("override 'seed' must look like key.sub=value")):
        load_config(JobConfig, None, ["seed"])
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="the top level of a config file must be a mapping"):
        load_config(JobConfig, path)


def layout_error(parallel, world_size=2, layers=8, heads=4, groups=2, experts=None):
    with pytest.raises(ValueError) as error:
        parallel.validate_for_model(world_size=world_size, num_layers=layers,
                                    num_attention_heads=heads, num_query_groups=groups,
                                    num_experts=experts)
    return str(error.value)


def test_numbers_in_exponent_notation_wherever_a_number_is_typed(tmp_path):
    """YAML 1.1 (PyYAML) reads ``1e-5`` and ``2E3`` as strings; a key typed as a number takes
    them as YAML 1.2 does, in the file and on the command line; a string key keeps the text."""
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  hf_path: 1e5\n  moe_aux_loss_coeff: 2e-3\n"
                    "learning_rates: [1e-5, 1E5, .5e1, -3.e+2]\n")
    config = load_config(JobConfig, path, ["seed=1e3"])
    assert config.model.moe_aux_loss_coeff == 2e-3
    assert config.model.hf_path == "1e5"
    assert config.learning_rates == [1e-5, 1e5, 5.0, -300.0]
    assert config.seed == 1000 and type(config.seed) is int
    grpo = load_config(GRPOJobConfig, CONFIGS / "grpo_tiny_cpu_colocated.yaml",
                       ["policy.optimizer.lr=1e-5", "policy.optimizer.adam_eps=1E-8",
                        "run.steps=2e1"])
    assert grpo.policy.optimizer.lr == 1e-5
    assert grpo.policy.optimizer.adam_eps == 1e-8
    assert grpo.run.steps == 20


@pytest.mark.parametrize(("value", "message"), [
    ("1.5e0", "config key 'seed' must be an integer, got '1.5e0' (= 1.5)"),
    ("1e-1", "config key 'seed' must be an integer, got '1e-1' (= 0.1)"),
    ("1e30", "config key 'seed' must be an integer, got '1e30' (too large)"),
    ("'2'", "config key 'seed' must be an integer, got '2'"),
    ("1e", "config key 'seed' must be an integer, got '1e'"),
])
def test_an_integer_key_takes_exponent_notation_only_when_exact(value, message):
    with pytest.raises(ConfigError) as error:
        load_config(JobConfig, None, ["model.hf_path=/c", f"seed={value}"])
    assert str(error.value) == message


def test_a_bad_override_value_names_the_override():
    with pytest.raises(ConfigError) as error:
        load_config(JobConfig, None, ["seed=[1,"])
    assert str(error.value) == ("override 'seed=[1,': while parsing a flow node expected the "
                                "node content, but found '<stream end>'")


def test_expert_layouts_rejected_before_building():
    assert layout_error(ParallelConfig(expert=2), world_size=3, experts=8) == (
        "world size 3 is not divisible by parallel.tensor × parallel.pipeline × "
        "parallel.expert = 1 × 1 × 2; launch a multiple of 2 ranks or lower parallel.expert")
    assert layout_error(ParallelConfig(expert=2, pipeline=2), world_size=2, experts=8) == (
        "world size 2 is not divisible by parallel.tensor × parallel.pipeline × "
        "parallel.expert = 1 × 2 × 2; launch a multiple of 4 ranks or lower parallel.expert")
    assert layout_error(ParallelConfig(expert=2)) == (
        "parallel.expert=2 needs a mixture-of-experts model; this one has no experts "
        "(set parallel.expert: 1)")
    assert layout_error(ParallelConfig(expert=4), world_size=4, experts=6) == (
        "parallel.expert=4 must divide the model's 6 experts per layer")
    assert layout_error(ParallelConfig(tensor=2), experts=8) == (
        "a mixture-of-experts model at parallel.tensor=2 needs parallel.sequence_parallel: true "
        "(megatron-core's MoELayer requires it with tensor parallelism), and sequence "
        "parallelism needs the transformer-engine layer spec")
    with pytest.raises(ValueError, match=re.escape(
            "parallel.expert must be a positive integer, got 0")):
        from_dict(JobConfig, {"model": {"hf_path": "/c"}, "parallel": {"expert": 0}})
    with pytest.raises(ValueError, match=re.escape(
            "model.moe_aux_loss_coeff must be ≥ 0, got -0.001")):
        from_dict(JobConfig, {"model": {"hf_path": "/c", "moe_aux_loss_coeff": -1e-3}})
    ParallelConfig(expert=2, pipeline=2).validate_for_model(
        world_size=4, num_layers=8, num_attention_heads=4, num_query_groups=2, num_experts=8)
    assert ParallelConfig(expert=2).data_parallel_size(2) == 2


def test_layouts_rejected_before_building():
    assert layout_error(ParallelConfig(pipeline=2, virtual_pipeline=3)) == (
        "the model's 8 layers do not divide into parallel.pipeline × "
        "parallel.virtual_pipeline = 2 × 3 = 6 stages; choose sizes whose product divides 8")
    assert layout_error(ParallelConfig(pipeline=3), world_size=3) == (
        "the model's 8 layers do not divide into parallel.pipeline = 3 stages; "
        "choose sizes whose product divides 8")
    assert layout_error(ParallelConfig(pipeline=2), world_size=3) == (
        "world size 3 is not divisible by parallel.tensor × parallel.pipeline = 1 × 2; "
        "launch a multiple of 2 ranks or change the layout")
    assert layout_error(ParallelConfig(tensor=4), world_size=4, groups=2) == (
        "parallel.tensor=4 must divide the model's 4 attention heads and 2 key/value heads")


def test_valid_layouts():
    ParallelConfig(pipeline=2, virtual_pipeline=4).validate_for_model(
        world_size=4, num_layers=8, num_attention_heads=4, num_query_groups=2)
    assert ParallelConfig(tensor=2, pipeline=2).data_parallel_size(8) == 2
    assert ParallelConfig(pipeline=2, virtual_pipeline=2).num_model_chunks == 2
    assert ParallelConfig().num_model_chunks == 1


@pytest.mark.skipif(te_available(), reason="transformer-engine is installed")
def test_layer_spec_without_transformer_engine():
    from mcore_refit.model import resolve_layer_spec

    assert resolve_layer_spec("auto", ParallelConfig()) == "local"
    assert resolve_layer_spec("local", ParallelConfig(tensor=2)) == "local"
    with pytest.raises(ValueError, match=re.escape(
            "model.layer_spec='te' needs transformer-engine, which does not import")):
        resolve_layer_spec("te", ParallelConfig())
    with pytest.raises(ValueError, match=re.escape(
            "parallel.sequence_parallel=true needs the transformer-engine layer spec; the local "
            "spec's torch LayerNorm does not support it (set parallel.sequence_parallel: false)")):
        resolve_layer_spec("auto", ParallelConfig(tensor=2, sequence_parallel=True))


@dataclass(frozen=True, kw_only=True)
class _Inner:
    RENAMED_KEYS = {"size": "shape.width"}
    width: int = 1

    def __post_init__(self) -> None:
        if self.width > 4:
            from mcore_refit.config import ConfigError

            raise ConfigError(f"config key '`width`' must be ≤ 4 (see `limit`), got {self.width}")


@dataclass(frozen=True, kw_only=True)
class _Outer:
    inner: _Inner = field(default_factory=_Inner)


@dataclass(frozen=True, kw_only=True)
class _Job:
    outer: _Outer = field(default_factory=_Outer)


def test_section_errors_name_the_full_dotted_key():
    with pytest.raises(ValueError) as error:
        from_dict(_Job, {"outer": {"inner": {"width": 9}}})
    assert str(error.value) == ("config key 'outer.inner.width' must be ≤ 4 "
                                "(see outer.inner.limit), got 9")
    with pytest.raises(ValueError) as error:
        _Inner(width=9)  # built in code, not from a config: keys relative to the section
    assert str(error.value) == "config key 'width' must be ≤ 4 (see limit), got 9"


def test_renamed_key_names_its_new_name():
    with pytest.raises(ValueError) as error:
        from_dict(_Job, {"outer": {"inner": {"size": 3}}})
    assert str(error.value) == ("config key 'outer.inner.size' was renamed "
                                "'outer.inner.shape.width'")


@pytest.mark.parametrize(("job", "overrides", "message"), [
    ("grpo", ["policy.optimizer.lr=0"], "policy.optimizer.lr must be a positive number, got 0.0"),
    ("grpo", ["policy.packing.pad_to_multiple=0"],
     "policy.packing.pad_to_multiple must be a positive integer, got 0"),
    ("grpo", ["inference.sampling.temperature=0"],
     "inference.sampling.temperature must be > 0, got 0.0"),
    ("grpo", ["task.kind=jsonl"], "task.kind=jsonl needs task.path"),
    ("grpo", ["parallel.pipeline=1", "parallel.virtual_pipeline=2"],
     "parallel.virtual_pipeline=2 needs parallel.pipeline > 1; set parallel.virtual_pipeline: "
     "null or raise parallel.pipeline"),
    ("grpo", ["refit.num_buffers=2"],
     "config key 'refit.num_buffers' was renamed 'refit.plan.num_slots'"),
    ("bench", ["megatron.parallel.virtual_pipeline=2"],
     "megatron.parallel.virtual_pipeline=2 needs megatron.parallel.pipeline > 1"),
    ("bench", ["megatron.parallel.tensor=0"],
     "megatron.parallel.tensor must be a positive integer, got 0"),
    ("bench", ["refit.plan.num_slots=0"], "refit.plan.num_slots must be"),
])
def test_a_nested_section_error_names_the_full_dotted_key(job, overrides, message):
    """Sections do not know where they are nested; the loader renders the whole path."""
    cls, path = {"grpo": (GRPOJobConfig, CONFIGS / "grpo_tiny_cpu_colocated.yaml"),
                 "bench": (RefitBenchJob, None)}[job]
    with pytest.raises(ConfigError) as error:
        load_config(cls, path, overrides)
    assert message in str(error.value)


@pytest.mark.parametrize(("sections", "message"), [
    ({"inference": {"num_ranks": 0}}, "inference.num_ranks must be ≥ 1, got 0"),
    ({"inference": {"timeout_s": 0}}, "inference.timeout_s must be > 0, got 0.0"),
    ({"grpo": {"prompts_per_step": 0}}, "grpo.prompts_per_step must be ≥ 1, got 0"),
    ({"grpo": {"samples_per_prompt": 1}},
     "grpo.samples_per_prompt must be ≥ 2 (advantages compare samples of one prompt), got 1"),
    ({"run": {"steps": 0}}, "run.steps must be ≥ 1, got 0"),
    ({"run": {"checkpoint_every": -1}}, "run.checkpoint_every must be ≥ 0, got -1"),
    ({"task": {"kind": "jsonl"}}, "task.kind=jsonl needs task.path"),
    ({"task": {"path": "/problems.jsonl"}}, "task.path is only used with task.kind=jsonl"),
    ({"task": {"kind": "csv"}},
     "config key 'task.kind' must be one of 'arithmetic', 'jsonl', got 'csv'"),
    ({"task": {"operation": "div"}},
     "config key 'task.operation' must be one of 'add', 'sub', 'mul', got 'div'"),
    ({"task": {"num_digits": 0}}, "task.num_digits must be ≥ 1, got 0"),
    ({"task": {"modulo": 1}}, "task.modulo must be ≥ 2 or null, got 1"),
    ({"task": {"num_digits": 2, "max_operand": 100}},
     "task.max_operand must be in [1, 99] for num_digits=2, got 100"),
    ({"policy": {"temperature": 0.5}},
     "policy.temperature=0.5 differs from inference.sampling.temperature=1.0; the trainer must "
     "score the distribution the engine samples from"),
    ({"inference": {"dtype": "bfloat16"}},
     "inference.dtype=bfloat16 differs from model.dtype=float32; refits copy tensors as exported"),
    ({"inference": {"engine": "sglang"}},
     "config key 'inference.engine' must be one of 'hf', 'vllm', got 'sglang'"),
    ({"inference": {"engine": "vllm", "sampling": {"top_p": 0.9}}},
     "inference.sampling.top_p=0.9 with inference.engine=vllm: vLLM reports the logprobs of the "
     "top-p-truncated distribution (renormalised over the nucleus), not the trainer's "
     "log_softmax(logits / T); use top_p=1, or the hf engine"),
    ({"inference": {"vllm": {"max_num_seqs": 0}}},
     "inference.vllm.max_num_seqs must be ≥ 1, got 0"),
    ({"grpo": {"kl_coef": 0.1}, "policy": {"reference_model": False}},
     "grpo.kl_coef > 0 needs policy.reference_model: true"),
    ({"refit": {"mode": "non_colocated", "transport": {"ipc_sharing": "weights"}}},
     "refit.transport.ipc_sharing=weights is for refit.mode=colocated"),
    ({"refit": {"mode": "colocated", "transport": {"ipc_sharing": "weights"}},
      "inference": {"offload_trainer": True}},
     "refit.transport.ipc_sharing=weights keeps the trainer's weights mapped by the engine, so "
     "inference.offload_trainer=true would free no memory; use ipc_sharing=buffers with "
     "offloading"),
    ({"refit": {"transport": {"ipc_sharing": "pages"}}},
     "config key 'refit.transport.ipc_sharing' must be one of 'buffers', 'weights', got 'pages'"),
])
def test_grpo_sections_name_the_full_dotted_key(sections, message):
    with pytest.raises(ConfigError) as error:
        from_dict(GRPOJobConfig, {"model": {"hf_path": "/ckpt"}, **sections})
    assert str(error.value) == message


def test_grpo_sections_built_in_code_name_their_own_keys():
    with pytest.raises(ConfigError) as error:
        InferenceConfig(num_ranks=0)
    assert str(error.value) == "num_ranks must be ≥ 1, got 0"
    with pytest.raises(ConfigError) as error:
        TaskConfig(max_operand=10)
    assert str(error.value) == "max_operand must be in [1, 9] for num_digits=1, got 10"


@pytest.mark.parametrize(("text", "message"), [
    ("model:\n  hf_path: /c\n  dtype: [float32\n",
     r"job.yaml:4:1: while parsing a flow sequence expected ',' or ']', but got '<stream end>'"),
    ("model:\n  hf_path: /c\n\tdtype: float32\n",
     r"job.yaml:3:1: while scanning for the next token found character '\\t'"),
    ("model:\n  hf_path: /c\n  hf_path: /d\n",
     r"job.yaml:3:3: duplicate key 'hf_path' \(first given on line 2\)"),
    ("model:\n  hf_path: /c\nseed: 1\nmodel:\n  dtype: float32\n",
     r"job.yaml:4:1: duplicate key 'model' \(first given on line 1\)"),
])
def test_yaml_errors_name_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}/{message}"):
        load_config(JobConfig, path)


def test_a_model_path_that_is_not_a_local_directory_needs_allow_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=(
            r"^hf_path='org/name' is not a local directory \(resolved from '.*'\); give the "
            r"path of a Hugging Face checkpoint, or set allow_hub: true to download it from "
            r"the Hugging Face Hub$")) as error:
        ModelConfig(hf_path="org/name").check_local()
    assert str(error.value.at("model")).startswith("model.hf_path='org/name' is not a local")
    ModelConfig(hf_path="org/name", allow_hub=True).check_local()
    (tmp_path / "org" / "name").mkdir(parents=True)
    ModelConfig(hf_path="org/name").check_local()


def test_one_section_reads_as_the_whole_config_reads_it(tmp_path):
    """What the recipe locks before building the job's config: the same run section, overrides
    applied, other sections (even wrong ones) left to the whole config's load."""
    path = tmp_path / "job.yaml"
    path.write_text("run: {output_dir: a, steps: 3}\npolicy: {no_such_key: 1}\n")
    run = load_section(RunConfig, path, ["run.output_dir=b"], "run")
    assert run == RunConfig(output_dir="b", steps=3)
    assert load_section(RunConfig, None, [], "run") == RunConfig()
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'run.stpes'")):
        load_section(RunConfig, path, ["run.stpes=1"], "run")
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'policy.no_such_key'")):
        load_config(GRPOJobConfig, path, ["model.hf_path=m"])
