"""Where a GRPO run's numbers go: metrics.jsonl, TensorBoard, wandb, config.yaml, the terminal,
metrics.png; and the one protocol the loop drives its rollouts through."""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mcore_refit.config import ConfigError, load_config
from mcore_refit.grpo import loop
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.console import Console
from mcore_refit.grpo.metrics import MetricsWriter, read_metrics, refit_metrics
from mcore_refit.grpo.plot import moving_average, plot_metrics, reward_limits
from mcore_refit.grpo.protocol import Rollouts
from mcore_refit.grpo.rollouts import ColocatedRollouts, NonColocatedRollouts
from mcore_refit.refit import RefitTelemetry

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny_cpu_colocated.yaml"


def job_config(tmp_path, *overrides) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, CONFIG, [f"run.output_dir={tmp_path}", *overrides])


def telemetry() -> RefitTelemetry:
    return RefitTelemetry(role="sender", transport="colocated", refit_index=3, device="cpu",
                          num_tensors=10, num_buffers=2, payload_bytes=2_000_000, total_s=0.004,
                          export_s=0.001, pack_s=0.002, transfer_s=0.003, wait_s=0.0005,
                          held_bytes=524288)


def records(num_steps: int) -> list[dict]:
    return [{"step": step, "reward_mean": step / (2 * num_steps),
             "logprob_mult_err": 1.0 + 2e-7 * (step % 3), "refit_s": 0.010 + 0.001 * step,
             "step_s": 0.4, **({"eval/reward_mean": step / num_steps} if step % 5 == 0 else {})}
            for step in range(1, num_steps + 1)]


def test_refit_telemetry_becomes_record_keys():
    assert refit_metrics(telemetry()) == {
        "refit_s": 0.004, "refit_gbps": 0.5, "refit/export_s": 0.001, "refit/pack_s": 0.002,
        "refit/transfer_s": 0.003, "refit/wait_s": 0.0005, "refit/checksum_s": 0.0,
        "refit/verify_s": 0.0, "refit/payload_bytes": 2_000_000, "refit/held_bytes": 524288}


def test_writer_fills_metrics_jsonl_tensorboard_and_config_yaml(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = job_config(tmp_path, "run.tensorboard=true", "policy.optimizer.lr=0.001")
    writer = MetricsWriter(config, enabled=True)
    rows = records(5)
    for row in rows:
        writer.log(row)
    writer.close()
    assert read_metrics(tmp_path) == rows
    # The resolved config (defaults and overrides included) reads back as the same config.
    assert load_config(GRPOJobConfig, tmp_path / "config.yaml") == config
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = [(event.step, event.value) for event in events.Scalars("reward_mean")]
    assert rewards == [(row["step"], pytest.approx(row["reward_mean"])) for row in rows]
    assert [(event.step, event.value) for event in events.Scalars("eval/reward_mean")] == [(5, 1.0)]


SAMPLES = [{"prompt": "5+7=", "completion": "12", "reward": 1.0},
           {"prompt": "9+9=", "completion": "1|8", "reward": 0.25}]


def test_sample_completions_go_to_metrics_jsonl_tensorboard_wandb_and_the_console(
        tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: types.SimpleNamespace(
        log=lambda data, *, step: logged.append((data, step)), finish=lambda: None)
    fake.Table = lambda *, columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = job_config(tmp_path, "run.tensorboard=true", "run.wandb.project=grpo-demo")
    writer = MetricsWriter(config, enabled=True)
    row = {**records(5)[-1], "eval/samples": SAMPLES}
    writer.log(row)
    writer.close()
    assert read_metrics(tmp_path) == [row]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("eval/samples/text_summary")
    assert text.step == 5 and text.tensor_proto.string_val[0].decode() == (
        "| prompt | completion | reward |\n| --- | --- | --- |\n| '5+7=' | '12' | 1.000 |\n"
        "| '9+9=' | '1\\|8' | 0.250 |")
    ((data, step),) = logged
    assert step == 5 and data["eval/samples"] == (
        "table", ["prompt", "completion", "reward"], [["5+7=", "12", 1.0], ["9+9=", "1|8", 0.25]])
    console = Console(total=5, initial=4, log_every=0, enabled=True)
    console.update(row)
    console.close()
    lines = [line for line in re.split(r"[\r\n]", capsys.readouterr().err)
             if line.startswith("eval ")]
    assert lines == ["eval step 5: '5+7=' -> '12' (reward 1.000)",
                     "eval step 5: '9+9=' -> '1|8' (reward 0.250)"]


def test_a_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(job_config(tmp_path / "run"), enabled=False)
    writer.log(records(1)[0])
    writer.close()
    assert not (tmp_path / "run").exists()


def test_wandb_gets_the_config_and_every_scalar(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, *, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = job_config(tmp_path, "run.wandb.project=grpo-demo", "run.wandb.mode=offline")
    writer = MetricsWriter(config, enabled=True)
    writer.log({"step": 1, "reward_mean": 0.5, "tokens": 7, "note": "text", "flag": True})
    writer.close()
    (_, init_kwargs), log, finish = calls
    assert init_kwargs["project"] == "grpo-demo" and init_kwargs["mode"] == "offline"
    assert init_kwargs["dir"] == str(tmp_path) and init_kwargs["name"] is None
    assert init_kwargs["config"]["run"]["wandb"]["project"] == "grpo-demo"
    assert init_kwargs["config"]["policy"]["optimizer"]["lr"] == config.policy.optimizer.lr
    assert log == ("log", {"reward_mean": 0.5, "tokens": 7}, 1)
    assert finish == ("finish",)


def test_wandb_without_the_extra_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec then reports it missing
    with pytest.raises(ConfigError, match=re.escape(
            "run.wandb.project is set but wandb is not installed: pip install "
            "'mcore_refit[wandb]' (or set it to null)")):
        job_config(tmp_path, "run.wandb.project=grpo-demo")
    with pytest.raises(ConfigError, match=re.escape(
            "config key 'run.wandb.mode' must be one of 'offline', 'online', got 'cloud'")):
        job_config(tmp_path, "run.wandb.mode=cloud")


def test_tensorboard_without_its_package_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=re.escape(
            "run.tensorboard is true but the tensorboard package (pinned in requirements.txt) is "
            "not installed; install it or set it to false")):
        job_config(tmp_path)
    assert not job_config(tmp_path, "run.tensorboard=false").run.tensorboard


def test_console_shows_a_bar_and_a_summary_line_every_n_steps(capsys):
    console = Console(total=10, initial=0, log_every=5, enabled=True)
    for row in records(10):
        console.update(row)
    console.close()
    console.write("metrics: run/metrics.jsonl, plot: run/metrics.png")
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout is left to the run's final JSON line
    assert captured.err.endswith("\nmetrics: run/metrics.jsonl, plot: run/metrics.png\n")
    lines = [line for line in re.split(r"[\r\n]", captured.err) if line.startswith("step ")]
    assert lines == [
        "step 5/10 | reward 0.150 (mean of last 5) | eval reward 0.500 | mult_err 1.0000004 "
        "| refit 15.0 ms | step 0.40 s",
        "step 10/10 | reward 0.400 (mean of last 5) | eval reward 1.000 | mult_err 1.0000002 "
        "| refit 20.0 ms | step 0.40 s"]
    bar = captured.err.split("\r")[-1]
    assert "10/10" in bar and "reward=0.500" in bar and "eval=1.000" in bar
    assert "mult_err=1.0000002" in bar and "refit=20.0ms" in bar


def test_a_disabled_console_prints_nothing(capsys):
    console = Console(total=2, initial=0, log_every=1, enabled=False)
    console.update(records(1)[0])
    console.close()
    console.write("not shown")
    assert capsys.readouterr() == ("", "")


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0], 5) == [2.0]
    with pytest.raises(ValueError, match="window must be ≥ 1, got 0"):
        moving_average([1.0], 0)


def test_reward_axis_shows_penalties_and_bonuses():
    assert reward_limits([0.1, 0.9]) == (-0.02, 1.02)
    assert reward_limits([-0.25, 0.5]) == (-0.27, 1.02)  # a truncation penalty
    assert reward_limits([0.2, 1.125]) == (-0.02, 1.145)  # a bonus


def test_plot_is_a_png_of_the_run(tmp_path):
    from PIL import Image

    path = plot_metrics(records(40), tmp_path / "plots" / "metrics.png", title="test run")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (750, 800)
        assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10  # not blank
    with pytest.raises(ValueError, match="no metrics to plot: the run logged no step"):
        plot_metrics([], tmp_path / "empty.png")


@pytest.mark.slow
def test_plot_recipe_writes_the_png_of_a_run_directory(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(
        f"{__import__('json').dumps(row)}\n" for row in records(12)))
    result = subprocess.run([sys.executable, str(REPO / "recipes" / "plot_metrics.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, str(REPO / "recipes" / "plot_metrics.py"),
                              str(tmp_path / "nothing")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode != 0
    assert "no metrics.jsonl in" in missing.stderr


@pytest.mark.parametrize("backend", [ColocatedRollouts, NonColocatedRollouts])
def test_both_backends_implement_the_rollouts_protocol(backend):
    for name in ("generate", "release", "refit", "close"):
        expected = inspect.signature(getattr(Rollouts, name))
        assert inspect.signature(getattr(backend, name)) == expected, (backend.__name__, name)


def test_the_loop_knows_rollouts_only_through_the_protocol():
    tree = ast.parse(inspect.getsource(loop))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert "mcore_refit.grpo.protocol" in imported
    assert not {"mcore_refit.grpo.rollouts", "mcore_refit.inference.process"} & imported
