"""The run directory: one run per directory, state read back with errors naming the file,
metrics truncated on resume."""

import json
import shutil

import pytest

from mcore_refit.grpo.rundir import RunDirectory
from tests.checkpoints import write_checkpoint


def finished_run(path, *, step=4, rows=5, earlier=()):
    """A run directory as a run that checkpointed ``earlier`` steps and ``step`` and logged
    ``rows`` steps leaves it."""
    for saved in (*earlier, step):
        write_checkpoint(path / "checkpoints" / f"step_{saved:06d}")
    (path / "trainer_state.json").write_text(
        json.dumps({"step": step, "checkpoint": f"checkpoints/step_{step:06d}"}))
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(1, rows + 1)))
    return RunDirectory(path)


def test_a_fresh_run_is_refused_in_a_directory_holding_another_run(tmp_path):
    finished_run(tmp_path)
    with pytest.raises(ValueError, match=(
            rf"run.output_dir '{tmp_path}' already holds a run \(trainer_state.json, "
            r"checkpoints, metrics.jsonl\); pass --resume to continue it, or choose another "
            r"run.output_dir")):
        RunDirectory(tmp_path).claim(resume=False, steps=8)


def test_a_fresh_run_may_use_an_empty_or_logs_only_directory(tmp_path):
    assert RunDirectory(tmp_path / "new").claim(resume=False, steps=8) is None
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")  # opened by a run that died in its start-up
    assert RunDirectory(tmp_path).claim(resume=False, steps=8) is None


def test_checkpoint_paths_are_relative_to_the_run_directory(tmp_path):
    finished_run(tmp_path / "original")
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    shutil.rmtree(tmp_path / "original")
    state = RunDirectory(tmp_path / "copy").claim(resume=True, steps=8)
    assert state.step == 4
    assert state.checkpoint == tmp_path / "copy" / "checkpoints" / "step_000004"


def test_an_absolute_checkpoint_path_is_refused(tmp_path):
    run = finished_run(tmp_path)
    run.state_file.write_text(json.dumps(
        {"step": 4, "checkpoint": str(tmp_path / "checkpoints" / "step_000004")}))
    with pytest.raises(ValueError, match="'checkpoint' must be a path relative to the run "
                                         "directory"):
        run.claim(resume=True, steps=8)


@pytest.mark.parametrize("steps", [2, 4])
def test_resuming_to_a_step_the_checkpoint_already_reached_is_refused(tmp_path, steps):
    with pytest.raises(ValueError, match=rf"--resume: run.steps={steps} but the checkpoint in "
                                         rf"'{tmp_path}' is at step 4; set run.steps above 4"):
        finished_run(tmp_path).claim(resume=True, steps=steps)


@pytest.mark.parametrize(("text", "message"), [
    ("", r"trainer_state.json is not valid JSON \(Expecting value at line 1, the file is "
         r"empty\)"),
    ("{\"step\": 4", r"trainer_state.json is not valid JSON"),
    ("[4]", r"trainer_state.json: expected a JSON object, got list"),
    ('{"step": 0, "checkpoint": "checkpoints/step_000004"}',
     r"trainer_state.json: 'step' must be a positive integer, got 0"),
    ('{"step": 4, "checkpoint": "checkpoints/step_000009"}',
     r"trainer_state.json names checkpoint '.*step_000009', which does not exist"),
])
def test_a_bad_state_file_is_named(tmp_path, text, message):
    run = finished_run(tmp_path)
    run.state_file.write_text(text)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/{message}"):
        run.claim(resume=True, steps=8)


def crashed_before_its_first_checkpoint(path):
    """What a run killed in step 3 before any save leaves."""
    (path / "logs").mkdir(parents=True)
    (path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')
    (path / "checkpoints" / "step_000002.partial").mkdir(parents=True)
    (path / "config.yaml").write_text("run: {}\n")
    return RunDirectory(path)


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_that_crashed_before_its_first_checkpoint_is_started_over(tmp_path, resume):
    run = crashed_before_its_first_checkpoint(tmp_path)
    assert run.claim(resume=resume, steps=8) is None
    assert run.leftovers() == ["metrics.jsonl (3 rows)", "checkpoints/step_000002.partial",
                               "config.yaml"]
    run.prepare_resume(None)
    assert run.metrics_file.read_text() == ""
    assert not (tmp_path / "checkpoints" / "step_000002.partial").exists()
    assert run.leftovers() == ["config.yaml"]  # rewritten by the new run


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint(tmp_path):
    run = finished_run(tmp_path, step=4, earlier=(2,))
    shard = tmp_path / "checkpoints" / "step_000004" / "__0_0.distcp"
    size = shard.stat().st_size
    with shard.open("r+b") as file:
        file.truncate(size - 100)
    state = run.claim(resume=True, steps=8)
    assert (state.step, state.checkpoint) == (2, tmp_path / "checkpoints" / "step_000002")
    assert state.passed_over == (f"{shard} is truncated: {size - 100} bytes, the checkpoint's "
                                 f"index needs {size}")
    # With no whole checkpoint left, every broken file is named.
    (tmp_path / "checkpoints" / "step_000002" / ".metadata").write_bytes(b"\x80\x04trunc")
    with pytest.raises(ValueError) as error:
        run.claim(resume=True, steps=8)
    assert str(error.value).startswith(
        f"--resume: no readable checkpoint in '{tmp_path}': {shard} is truncated: "
        f"{size - 100} bytes, the checkpoint's index needs {size}; "
        f"{tmp_path / 'checkpoints' / 'step_000002' / '.metadata'} is unreadable (")
    assert str(error.value).endswith("; restore the files, or start a new run")


@pytest.mark.parametrize(("damage", "message"), [
    ("metadata.json", "{dir}/metadata.json is missing"),
    (".metadata", "{dir}/.metadata is missing"),
    ("__0_0.distcp", "{dir}/__0_0.distcp is missing (the checkpoint's index names it)"),
])
def test_a_missing_checkpoint_file_is_named(tmp_path, damage, message):
    from mcore_refit.files import CorruptFile, check_distributed_checkpoint

    directory = write_checkpoint(tmp_path / "step_000002")
    check_distributed_checkpoint(directory)
    (directory / damage).unlink()
    with pytest.raises(CorruptFile) as error:
        check_distributed_checkpoint(directory)
    assert str(error.value) == message.format(dir=directory)


def test_resume_forgets_rows_after_the_checkpoint_and_partial_checkpoints(tmp_path):
    run = finished_run(tmp_path, step=4, rows=6)
    with run.metrics_file.open("a") as file:
        file.write('{"step": 7, "rew')  # cut short by a kill
    (tmp_path / "checkpoints" / "step_000006.partial").mkdir()
    run.prepare_resume(run.claim(resume=True, steps=8))
    steps = [json.loads(line)["step"] for line in run.metrics_file.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]


@pytest.fixture
def one_rank():
    """The control group of a one-rank gloo job (this process)."""
    import torch.distributed as dist

    from mcore_refit.control import ControlGroup

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ControlGroup(None, timeout_s=30)
    finally:
        dist.destroy_process_group()


class SavingPolicy:
    """Writes a small checkpoint where the run directory asks, or fails as told."""

    def __init__(self, error=None):
        self.error = error

    def save_checkpoint(self, path):
        if self.error is not None:
            raise self.error
        write_checkpoint(path)


def test_saves_keep_the_newest_checkpoints_and_leave_later_attempts(tmp_path, one_rank):
    run = RunDirectory(tmp_path)
    write_checkpoint(tmp_path / "checkpoints" / "step_000009")  # an earlier attempt's
    for step in (2, 4, 6):
        run.save_checkpoint(SavingPolicy(), step=step, extra={}, control=one_rank, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000004", "step_000006", "step_000009"]
    assert json.loads(run.state_file.read_text())["checkpoint"] == "checkpoints/step_000006"
    run.save_checkpoint(SavingPolicy(), step=8, extra={}, control=one_rank, keep=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000008", "step_000009"]


def test_a_failed_save_names_the_checkpoint_on_every_rank(tmp_path, one_rank):
    import errno

    from mcore_refit.control import RankFailure

    run = RunDirectory(tmp_path)
    full = SavingPolicy(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(RankFailure) as error:
        run.save_checkpoint(full, step=2, extra={}, control=one_rank, keep=2)
    partial = tmp_path / "checkpoints" / "step_000002.partial"
    assert str(error.value).startswith(
        f"the checkpoint of step 2 failed on trainer rank 0: OSError: [Errno 28] no space left "
        f"on device writing {partial}\n")
    assert not run.state_file.exists()
