"""The GRPO recipe end to end on CPU: learning, logprob agreement, both modes, resume, two jobs on
one host, users' own data, reward and eval set."""

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import REPO_ROOT, last_json_line, run_torchrun
from tests.ranks import run_script

RECIPE = REPO_ROOT / "recipes" / "grpo.py"
COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_colocated.yaml"
NON_COLOCATED = REPO_ROOT / "configs" / "grpo_tiny_cpu_non_colocated.yaml"
FAULTS = REPO_ROOT / "tests" / "dist" / "scenarios" / "grpo_faults.py"
# fp32 on CPU: trainer and engine agree to ~2e-7 per token (measured); a wrong tensor is far off.
MULT_ERR_BOUND = 1.0001


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("grpo") / "tiny-llama",
                                 TinyModelSpec(num_layers=8))


def metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values):
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def colocated_run(checkpoint, tmp_path_factory):
    """The demo's colocated job for 100 steps, checkpointed at 50 and 100: the learning test, the
    console test and the resume test read this one launch (under torchrun: the console test
    reads what its terminal shows)."""
    out = tmp_path_factory.mktemp("colocated") / "run"
    result = run_torchrun(RECIPE, "--config", str(COLOCATED), f"model.hf_path={checkpoint}",
                          f"run.output_dir={out}", "run.steps=100", "run.checkpoint_every=50",
                          nproc=2, timeout_s=540)
    return result, out


@pytest.mark.timeout(600)
def test_colocated_run_learns_and_engine_matches_trainer(colocated_run):
    result, out = colocated_run
    summary = last_json_line(result.stdout)
    assert summary["steps"] == 100 and summary["mode"] == "colocated"
    assert summary["device"] == "cpu"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    records = metrics(out)
    rewards = [record["reward_mean"] for record in records]
    assert len(rewards) == 100
    # Random init rarely samples the stop token within the budget (penalised) and almost never
    # a right digit; within the run it learns to answer with two digits and to stop.
    assert mean(rewards[:10]) < 0.05
    assert mean(rewards[-20:]) > mean(rewards[:10]) + 0.3
    assert mean([r["truncated_fraction"] for r in records[-20:]]) < 0.1
    assert mean([r["completion_tokens_mean"] for r in records[-20:]]) > 2.5
    assert [r["step"] for r in records if "eval/reward_mean" in r] == [25, 50, 75, 100]
    assert (out / "trainer_state.json").exists()


@pytest.mark.timeout(600)
def test_the_console_shows_our_lines_only(colocated_run):
    # Third-party start-up output (Megatron-Bridge's import traceback and prints, torch's and
    # transformers' warnings, progress bars) goes to the per-rank logs; the terminal shows the
    # progress bar, then our summary lines. No leaked semaphore at exit.
    result, out = colocated_run
    terminal = result.stdout + result.stderr
    for noise in ("Traceback", "deprecated", "No CUDA runtime", "number of parameters",
                  "Loading", "leaked semaphore"):
        assert noise not in terminal, f"{noise!r} on the terminal:\n{terminal[-3000:]}"
    before_progress = result.stderr.split("grpo:", 1)[0].splitlines()
    assert "grpo:" in result.stderr and len(before_progress) <= 3, before_progress
    logged = (out / "logs" / "rank0.log").read_text()
    assert "number of parameters" in logged and "torch_dtype" in logged


@pytest.mark.timeout(600)
def test_non_colocated_run_refits_by_broadcast(checkpoint, tmp_path):
    out = tmp_path / "run"
    # On forked ranks (tests.ranks), as every launch here whose claim is not the launcher's.
    result = run_script(RECIPE, "--config", str(NON_COLOCATED), f"model.hf_path={checkpoint}",
                        f"run.output_dir={out}", "run.steps=20", "run.verify_refit=true",
                        nproc=3, timeout_s=540)
    summary = last_json_line(result.stdout)
    assert summary["steps"] == 20 and summary["mode"] == "non_colocated"
    assert 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 21))
    assert mean([r["reward_mean"] for r in records[-5:]]) > mean(
        [r["reward_mean"] for r in records[:5]])


def run_fault(fault, checkpoint, tmp_path, *overrides):
    run_script(FAULTS, "--fault", fault, "--config", str(COLOCATED), "--out", str(tmp_path),
               f"model.hf_path={checkpoint}", f"run.output_dir={tmp_path / 'run'}", *overrides,
               nproc=2, timeout_s=540)


@pytest.mark.timeout(600)
def test_corrupted_refit_breaks_logprob_agreement(checkpoint, tmp_path):
    run_fault("corrupt", checkpoint, tmp_path, "run.steps=2")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["logprob_mult_err_max"] > 1.01


@pytest.mark.timeout(600)
def test_an_engine_dying_fails_the_refit_on_every_rank(checkpoint, tmp_path):
    # Rank 1's engine is killed before the second refit; rank 0's refit succeeds. Both ranks
    # must raise the same error, not leave rank 0 in a collective until the timeout.
    run_fault("kill_engine", checkpoint, tmp_path, "run.steps=3")
    raised = raised_on_both_ranks(tmp_path)
    assert re.match(r"RankFailure: refit failed on trainer rank 1: EngineError: the inference "
                    r"engine process \(pid \d+\) exited with code -9", raised), raised
    assert "trainer rank 0" not in raised


@pytest.mark.timeout(600)
def test_an_engine_that_cannot_connect_fails_every_rank_before_the_export(checkpoint, tmp_path):
    run_fault("fail_connect", checkpoint, tmp_path, "run.steps=1")
    raised = raised_on_both_ranks(tmp_path)
    assert raised.startswith("RankFailure: connecting the inference engine failed on trainer "
                             "rank 0: ValueError: injected connect failure\nTraceback"), raised
    assert "in _connect" in raised and "also failed" not in raised


@pytest.mark.timeout(600)
def test_a_failed_broadcast_refit_fails_every_trainer_rank(checkpoint, tmp_path):
    # Trainer rank 0's export misnames a tensor in the second refit: the broadcast aborts, both
    # trainer ranks raise rank 0's error, and the inference rank is stopped cleanly.
    run_script(FAULTS, "--fault", "misname_refit", "--config", str(NON_COLOCATED),
               "--out", str(tmp_path), f"model.hf_path={checkpoint}",
               f"run.output_dir={tmp_path / 'run'}", "run.steps=3",
               "refit.transport.timeout_s=60", nproc=3, timeout_s=540)
    raised = raised_on_both_ranks(tmp_path)
    assert raised.startswith("RefitError: refit 1 failed on trainer rank 0: packing buffer 0: "
                             "ValueError: the weight source yielded 'model.misnamed.weight'"), \
        raised
    assert "Traceback (most recent call last)" in raised, raised
    assert "'model.misnamed.weight'" in raised, raised
    assert not (tmp_path / "rank2.txt").exists()


def raised_on_both_ranks(tmp_path) -> str:
    raised = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert raised[0] == raised[1], raised
    return raised[0]


@pytest.mark.timeout(600)
def test_resume_continues_from_the_last_checkpoint(checkpoint, colocated_run, tmp_path):
    _, finished = colocated_run
    out = shutil.copytree(finished, tmp_path / "run")  # the learning test reads the original
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 100
    resumed = run_script(RECIPE, "--config", str(COLOCATED), f"model.hf_path={checkpoint}",
                         f"run.output_dir={out}", "run.checkpoint_every=50", "run.steps=102",
                         "--resume", nproc=2, timeout_s=540)
    assert last_json_line(resumed.stdout)["steps"] == 2
    assert [r["step"] for r in metrics(out)] == list(range(1, 103))
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 102


def launch_one_step(checkpoint, out, *, standalone):
    return run_torchrun(RECIPE, "--config", str(COLOCATED), f"model.hf_path={checkpoint}",
                        f"run.output_dir={out}", "run.steps=1", "parallel.pipeline=1",
                        "parallel.virtual_pipeline=null", nproc=1, timeout_s=300,
                        standalone=standalone)


USER_REWARD = """
def bonus_match(problem, completion):
    return problem.record["bonus"] + (1.0 if completion.strip() == problem.answer else 0.0)
"""


def launch_jsonl_job(checkpoint, folder):
    """A user's dataset with keys of their own, a reward function by import path that reads
    another key of the line, and a validation set of every line of a second file."""
    lines = [{"question": f"{a}+{b}", "target": str(a + b), "bonus": 0.125}
             for a in range(10) for b in range(10)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:80]))
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[80:]))
    (folder / "my_rewards.py").write_text(USER_REWARD)
    task = ["kind=jsonl", "prompt_key=question", "answer_key=target",
            "prompt_template='{prompt}='"]
    return run_torchrun(
        RECIPE, "--config", str(COLOCATED), f"model.hf_path={checkpoint}",
        f"run.output_dir={folder / 'run'}", "run.steps=3", "run.eval_every=2",
        "parallel.pipeline=1", "parallel.virtual_pipeline=null", "grpo.prompts_per_step=8",
        "grpo.samples_per_prompt=4", "task.reward=my_rewards:bonus_match",
        "grpo.truncated_penalty=0", f"task.path={folder / 'train.jsonl'}",
        *[f"task.{o}" for o in task], "eval.num_problems=null",
        f"eval.path={folder / 'eval.jsonl'}", *[f"eval.{o}" for o in task],
        nproc=1, timeout_s=540,
        env={"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])})


@pytest.fixture(scope="module")
def jsonl_job_and_neighbour(checkpoint, tmp_path_factory):
    """The users'-data job and, at the same time, a one-step job, both launched with a plain
    torchrun on free ports (each job named "none"): the data test reads the first, the
    shared-host test both. On GPUs, where jobs do not share a device, the data job runs alone.
    Returns (data job, its folder, neighbour or None)."""
    folder = tmp_path_factory.mktemp("jsonl")
    if torch.cuda.is_available():
        return launch_jsonl_job(checkpoint, folder), folder, None
    with ThreadPoolExecutor(max_workers=2) as pool:
        data_job = pool.submit(launch_jsonl_job, checkpoint, folder)
        neighbour = pool.submit(launch_one_step, checkpoint, folder / "neighbour",
                                standalone=False)
        return data_job.result(), folder, neighbour.result()


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs each trainer owns its device")
def test_two_colocated_jobs_share_a_host(checkpoint, jsonl_job_and_neighbour, tmp_path):
    # As the README launches them: --standalone, each job on a port torchrun picks (the default
    # port 29500 would be taken by the first). With a plain torchrun on two free ports, every
    # job is named "none" and the engines' sockets must still not collide: the data job and
    # its neighbour.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda name: launch_one_step(checkpoint, tmp_path / name,
                                                             standalone=True),
                                ["first", "second"]))
    assert [last_json_line(result.stdout)["steps"] for result in results] == [1, 1]
    data_job, _, neighbour = jsonl_job_and_neighbour
    assert [last_json_line(result.stdout)["steps"] for result in (data_job, neighbour)] == [3, 1]


@pytest.mark.timeout(600)
def test_jsonl_data_custom_reward_and_eval_set(jsonl_job_and_neighbour):
    result, folder, _ = jsonl_job_and_neighbour
    summary = last_json_line(result.stdout)
    assert summary["steps"] == 3 and 1.0 <= summary["logprob_mult_err_max"] < MULT_ERR_BOUND
    records = metrics(folder / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert 0.125 <= record["reward_mean"] <= 1.125  # the user's reward, bonus included
    assert ["eval/reward_mean" in r for r in records] == [False, True, True]
    for record in records[1:]:
        assert 0.125 <= record["eval/reward_mean"] <= 1.125
        assert 0.0 <= record["eval/accuracy"] <= 1.0
    assert summary["eval_reward_last"] == records[-1]["eval/reward_mean"]
