"""Launch checks that run before the slow start-up: torchrun's variables, the launch's size
against the config, local files."""

import json
import shutil
from pathlib import Path

import pytest

from mcore_refit.config import ConfigError, load_config
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.job import validate_launch
from mcore_refit.launch import LaunchError, TorchrunRanks
from mcore_refit.tiny import write_tiny_checkpoint
from tests.checkpoints import write_checkpoint
from tests.launch import REPO_ROOT

COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
NON_COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_non_colocated.yaml"
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_torchrun_ranks_from_the_environment():
    assert TorchrunRanks.from_environment(TORCHRUN, command="x") == TorchrunRanks(
        rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="127.0.0.1",
        master_port=29500)


def test_without_torchrun_the_error_says_how_to_launch():
    with pytest.raises(LaunchError, match=r"^RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                                          r"MASTER_ADDR, MASTER_PORT not set: this recipe "
                                          r"runs under torchrun, e.g. `torchrun x`$"):
        TorchrunRanks.from_environment({"PATH": "/bin"}, command="torchrun x")
    with pytest.raises(LaunchError, match="RANK=2 is outside WORLD_SIZE=2"):
        TorchrunRanks.from_environment({**TORCHRUN, "RANK": "2"}, command="x")


def config(tmp_path, path=COLOCATED, *overrides, model=None):
    return load_config(GRPOJobConfig, path, [f"model.hf_path={model or tmp_path}",
                                             f"run.output_dir={tmp_path / 'run'}", *overrides])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("launch") / "tiny-llama")


def copy_of(model, tmp_path, **changes):
    """A copy of the checkpoint ``model`` with ``changes`` to its config.json."""
    copy = Path(shutil.copytree(model, tmp_path / "model"))
    settings = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**settings, **changes}))
    return copy


@pytest.mark.parametrize(("path", "world_size", "overrides", "message"), [
    (NON_COLOCATED, 2, [],
     "2 launched ranks less inference.num_ranks=1 leave 1 trainer rank(s), which do not divide "
     "into parallel.tensor × parallel.pipeline = 1 × 2; launch 3 ranks (2 trainer + 1 inference)"),
    (NON_COLOCATED, 1, [],
     "inference.num_ranks=1 leaves no trainer rank among the 1 launched ranks "
     "(refit.mode=non_colocated); launch at least 2"),
    (COLOCATED, 3, [],
     "3 launched ranks do not divide into parallel.tensor × parallel.pipeline = 1 × 2; launch a "
     "multiple of 2 ranks"),
    (COLOCATED, 2, ["grpo.prompts_per_step=1"],
     "grpo.prompts_per_step=1 is smaller than the 2 inference engines (one per launched rank, "
     "refit.mode=colocated); every engine needs at least one prompt per step"),
    (NON_COLOCATED, 4, ["inference.num_ranks=2", "grpo.prompts_per_step=1"],
     "grpo.prompts_per_step=1 is smaller than the 2 inference engines (inference.num_ranks); "
     "every engine needs at least one prompt per step"),
    (COLOCATED, 2, ["task.kind=jsonl", "task.path=/nonexistent/problems.jsonl"],
     "task: [Errno 2] No such file or directory: '/nonexistent/problems.jsonl'"),
    (COLOCATED, 2, ["eval.kind=jsonl", "eval.path=/nonexistent/val.jsonl"],
     "eval: [Errno 2] No such file or directory: '/nonexistent/val.jsonl'"),
])
def test_a_launch_that_does_not_fit_the_config_fails_before_the_start_up(
        tmp_path, path, world_size, overrides, message):
    with pytest.raises(ConfigError) as error:
        validate_launch(config(tmp_path, path, *overrides), world_size=world_size, resume=False)
    assert str(error.value) == message


def test_a_launch_checks_the_model_path_and_the_run_directory(tmp_path, tiny_model):
    job = config(tmp_path, model=tiny_model)
    validate_launch(job, world_size=2, resume=False)
    with pytest.raises(ConfigError, match=r"^model.hf_path='.*/missing' is not a local "
                                          r"directory"):
        validate_launch(config(tmp_path / "missing"), world_size=2, resume=False)
    # A run that crashed before its first checkpoint leaves a directory the next run may take.
    (tmp_path / "run" / "checkpoints" / "step_000002.partial").mkdir(parents=True)
    validate_launch(job, world_size=2, resume=False)
    (tmp_path / "run" / "checkpoints" / "step_000002").mkdir()
    with pytest.raises(ValueError, match="already holds a run"):
        validate_launch(job, world_size=2, resume=False)


def test_resuming_with_another_learning_rate_is_refused_before_the_start_up(tmp_path,
                                                                             tiny_model):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "step_000002")
    settings = dict(config(tmp_path).policy.optimizer.__dict__)
    (run / "trainer_state.json").write_text(json.dumps(
        {"step": 2, "checkpoint": "checkpoints/step_000002", "optimizer": settings}))
    validate_launch(config(tmp_path, model=tiny_model), world_size=2, resume=True)
    with pytest.raises(ValueError) as error:
        validate_launch(config(tmp_path, COLOCATED, "policy.optimizer.lr=0.001",
                               model=tiny_model), world_size=2, resume=True)
    assert str(error.value) == (
        f"--resume: policy.optimizer.lr=0.001 (checkpoint: {settings['lr']!r}) differs from the "
        f"run in '{run}'; a resumed run keeps the optimizer settings it was started with (its "
        "optimizer state and schedule are restored as saved): restore them, or start a new run "
        "from the checkpoint's weights")


def test_a_truncated_model_file_is_named_before_the_start_up(tmp_path, tiny_model):
    model = copy_of(tiny_model, tmp_path)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as file:
        file.truncate(size - 1000)
    with pytest.raises(ConfigError) as error:
        validate_launch(config(tmp_path, model=model), world_size=2, resume=False)
    assert str(error.value) == (f"model.hf_path: {weights} is truncated: {size - 1000} bytes, "
                                f"its header needs {size} (a download or copy cut short?)")
    with weights.open("r+b") as file:
        file.truncate(5)
    with pytest.raises(ConfigError, match=rf"^model.hf_path: {weights} is not a safetensors "
                                          r"file \(5 bytes"):
        validate_launch(config(tmp_path, model=model), world_size=2, resume=False)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, tiny_model):
    model = copy_of(tiny_model, tmp_path, vocab_size=64)
    with pytest.raises(ConfigError) as error:
        validate_launch(config(tmp_path, model=model), world_size=2, resume=False)
    assert str(error.value) == (
        f"model.hf_path: the tokenizer has 99 tokens but the model's vocabulary holds 64 "
        f"(vocab_size in {model / 'config.json'}): token ids from the tokenizer would index "
        "past the embedding; use the model's own tokenizer")


def test_prompts_that_leave_no_room_for_the_completion_are_refused(tmp_path, tiny_model):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                        + json.dumps({"prompt": "9" * 250 + "+1=", "answer": "x"}) + "\n")
    job = config(tmp_path, COLOCATED, "task.kind=jsonl", f"task.path={problems}",
                 model=tiny_model)
    with pytest.raises(ConfigError) as error:
        validate_launch(job, world_size=2, resume=False)
    assert str(error.value) == (
        f"task: a prompt ('{'9' * 60}'…) is 253 tokens; with inference.sampling.max_new_tokens=4 "
        f"it needs 257 positions, more than the model's 256 (max_position_embeddings in "
        f"{tiny_model / 'config.json'}): shorten the prompts or lower "
        "inference.sampling.max_new_tokens")
    validate_launch(config(tmp_path, COLOCATED, "task.kind=jsonl", f"task.path={problems}",
                           "inference.sampling.max_new_tokens=3", model=tiny_model),
                    world_size=2, resume=False)
    with pytest.raises(ConfigError, match=r"^eval: a prompt .* is 12 tokens; with "
                                          r"inference.sampling.max_new_tokens=250 it needs 262"):
        validate_launch(config(tmp_path, COLOCATED, "inference.sampling.max_new_tokens=250",
                               'eval.prompt_template="Compute {prompt}"', model=tiny_model),
                        world_size=2, resume=False)


def test_weights_read_in_place_on_cpu_refuse_the_distributed_optimizer_by_name():
    """On CPU the job moves the policy's parameters into shared memory for the engine to read;
    the distributed optimizer's parameters are views of its buffer, which the move would cut
    them from. On a GPU the parameters are shared as they are."""
    import torch

    from mcore_refit.grpo.job import weights_readable_by_the_engine

    config = load_config(GRPOJobConfig, REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml",
                         ["model.hf_path=/ckpt", "refit.transport.ipc_sharing=weights",
                          "policy.optimizer.use_distributed_optimizer=true"])
    with pytest.raises(ConfigError) as error:
        with weights_readable_by_the_engine(config, policy=None, device=torch.device("cpu")):
            pass
    assert str(error.value) == (
        "refit.transport.ipc_sharing=weights on CPU moves the parameters into shared memory, "
        "which policy.optimizer.use_distributed_optimizer=true does not allow (its parameters "
        "are views of its buffer); use ipc_sharing=buffers")
    with weights_readable_by_the_engine(config, policy=None, device=torch.device("cuda", 0)):
        pass  # nothing to move
