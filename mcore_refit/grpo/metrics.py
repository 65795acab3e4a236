"""Where a GRPO run's numbers go: ``metrics.jsonl``, TensorBoard, optionally wandb.

One writer, on the logging rank (global rank 0), owns every sink. Each step's record is one JSON
line of ``output_dir/metrics.jsonl`` (flat keys: ``reward_mean``, ``refit_s``,
``refit/export_s``, ``eval/reward_mean``, a few ``eval/samples``), the same scalars (and the
samples as text) as TensorBoard events under
``output_dir/tensorboard`` and, with ``run.wandb.project`` set, a wandb run. The run's resolved
config is written beside them as ``output_dir/config.yaml``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mcore_refit.config import save_config, to_dict
from mcore_refit.files import writing
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.evaluation import SAMPLES_KEY
from mcore_refit.refit import RefitTelemetry

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"

# The refit's telemetry in each step's record (besides refit_s and refit_gbps): phases, bytes,
# memory. See mcore_refit.refit.telemetry for their meanings.
_REFIT_KEYS = ("export_s", "pack_s", "transfer_s", "wait_s", "checksum_s", "verify_s",
               "payload_bytes", "held_bytes", "peak_extra_bytes", "new_allocations")


def refit_metrics(telemetry: RefitTelemetry) -> dict[str, float | int]:
    """A refit's measurements as record keys: ``refit_s``, ``refit_gbps``, ``refit/<phase>``."""
    data = telemetry.as_dict()
    record: dict[str, float | int] = {"refit_s": telemetry.total_s, "refit_gbps": data["gbps"]}
    for key in _REFIT_KEYS:
        if data.get(key) is not None:
            record[f"refit/{key}"] = data[key]
    return record


def samples_markdown(samples: list[Mapping[str, Any]]) -> str:
    """Sample completions as a Markdown table (TensorBoard's text tab renders it)."""
    def cell(text: str) -> str:
        return repr(text).replace("|", "\\|")

    rows = [f"| {cell(s['prompt'])} | {cell(s['completion'])} | {s['reward']:.3f} |"
            for s in samples]
    return "\n".join(["| prompt | completion | reward |", "| --- | --- | --- |", *rows])


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of ``run_dir/metrics.jsonl``, in file order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: not a GRPO run directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Step records to every configured sink; does nothing unless ``enabled``. Call
    :meth:`close`."""

    def __init__(self, config: GRPOJobConfig, *, enabled: bool,
                 purge_step: int | None = None) -> None:
        """``purge_step``: on resume, the first step written again; TensorBoard drops the events
        it holds from that step on."""
        self._enabled = enabled
        self._file = None
        self._tensorboard = None
        self._wandb = None
        if not enabled:
            return
        output_dir = Path(config.run.output_dir)
        with writing(output_dir / CONFIG_FILE):
            save_config(config, output_dir / CONFIG_FILE)
        self._path = output_dir / METRICS_FILE
        with writing(self._path):
            self._file = self._path.open("a")
        if config.run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(output_dir / TENSORBOARD_DIR),
                                              purge_step=purge_step)
        wandb_config = config.run.wandb
        if wandb_config.project is not None:
            import wandb  # the optional extra; its presence was checked with the config

            self._wandb = wandb.init(project=wandb_config.project, mode=wandb_config.mode,
                                     name=wandb_config.name, dir=str(output_dir),
                                     config=to_dict(config))

    def log(self, record: Mapping[str, Any]) -> None:
        """Write one step's record (it must have an integer ``step``)."""
        if not self._enabled:
            return
        step = record["step"]
        with writing(self._path):
            self._file.write(json.dumps(dict(record)) + "\n")
            self._file.flush()
        scalars = {key: value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float))
                   and not isinstance(value, bool)}
        samples = record.get(SAMPLES_KEY)
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            if samples:
                self._tensorboard.add_text(SAMPLES_KEY, samples_markdown(samples), step)
        if self._wandb is not None:
            logged = dict(scalars)
            if samples:
                import wandb

                logged[SAMPLES_KEY] = wandb.Table(
                    columns=["prompt", "completion", "reward"],
                    data=[[s["prompt"], s["completion"], s["reward"]] for s in samples])
            self._wandb.log(logged, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
