"""A GRPO run's directory (``run.output_dir``): owned by one run, resumed from what it records.

    run_dir = RunDirectory(config.run.output_dir)
    state = run_dir.claim(resume=resume, steps=config.run.steps)   # None for a fresh run
    ...
    run_dir.save_checkpoint(policy, step=step, extra=..., control=trainers)  # collective

Layout::

    run.lock                held by global rank 0 for the run's life (:mod:`.runlock`)
    trainer_state.json      {"step": n, "checkpoint": "checkpoints/step_<n>", ...} (relative)
    metrics.jsonl           one row per step; never a step twice
    checkpoints/step_<n>/   complete checkpoints; step_<n>.partial/ while one is being written
    logs/rank<r>.log

A checkpoint is written under a ``.partial`` name and renamed once every rank has finished, then
``trainer_state.json`` is replaced (write, then rename): a process killed during a save leaves the
previous state pointing at the previous complete checkpoint. Paths in the state file are relative
to the run directory, so a copied or moved run resumes from its own checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_refit.control import ControlGroup

STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class RunState:
    """What ``trainer_state.json`` records about the latest complete checkpoint."""

    step: int
    # Absolute, resolved against the run directory it was read from.
    checkpoint: Path
    # Anything else the loop stored beside it (e.g. the optimizer settings).
    extra: dict[str, Any] = field(default_factory=dict)


class RunDirectory:
    """The files of one run under ``path``; see the module docstring for the layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    def claim(self, *, resume: bool, steps: int) -> RunState | None:
        """Check that this run may use the directory; return the state to resume from.

        A fresh run (``resume`` false) is refused in a directory that already holds a run's
        metrics, state or checkpoints. A resumed run needs a readable state whose step is below
        ``steps``. Reads only: safe to call on every rank before any rank writes.
        """
        if not resume:
            found = self._run_files()
            if found:
                raise ValueError(
                    f"run.output_dir {str(self.path)!r} already holds a run ({', '.join(found)}); "
                    "pass --resume to continue it, or choose another run.output_dir")
            return None
        state = self.read_state()
        if steps <= state.step:
            raise ValueError(
                f"--resume: run.steps={steps} but the checkpoint in {str(self.path)!r} is at step "
                f"{state.step}; set run.steps above {state.step} to train further")
        return state

    def read_state(self) -> RunState:
        """The latest complete checkpoint; errors name the file and what is wrong with it."""
        where = str(self.state_file)
        if not self.state_file.is_file():
            raise ValueError(f"--resume: no {STATE_FILE} in {str(self.path)!r}; nothing to resume "
                             "from")
        text = self.state_file.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error.msg} at line {error.lineno}"
                             f"{', the file is empty' if not text.strip() else ''}); restore it "
                             "or start a new run") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        step, checkpoint = data.pop("step", None), data.pop("checkpoint", None)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{where}: 'step' must be a positive integer, got {step!r}")
        if not isinstance(checkpoint, str) or Path(checkpoint).is_absolute():
            raise ValueError(f"{where}: 'checkpoint' must be a path relative to the run "
                             f"directory, got {checkpoint!r}")
        path = self.path / checkpoint
        if not path.is_dir():
            raise ValueError(f"{where} names checkpoint {str(path)!r}, which does not exist")
        return RunState(step=step, checkpoint=path, extra=data)

    def prepare_resume(self, state: RunState) -> None:
        """Forget everything after ``state``: metrics rows of later steps, partial checkpoints.

        Call on one rank (the logging rank) before the resumed run writes anything.
        """
        if self.metrics_file.exists():
            kept = []
            for line in self.metrics_file.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a row cut short by a killed process
                if isinstance(row, dict) and isinstance(row.get("step"), int) \
                        and row["step"] <= state.step:
                    kept.append(line)
            _replace_text(self.metrics_file, "".join(f"{line}\n" for line in kept))
        for partial in self.path.glob(f"{CHECKPOINTS_DIR}/*{PARTIAL_SUFFIX}"):
            shutil.rmtree(partial)

    def save_checkpoint(self, policy, *, step: int, extra: dict[str, Any],
                        control: ControlGroup) -> Path:
        """Save ``policy`` as the checkpoint of ``step`` and record it as the latest.

        Collective over the trainer ranks, whose host group ``control`` is (its rank 0 renames
        and records). The state file changes only after every rank has written its shards and
        the directory has its final name. The ranks wait for each other on ``control``, so a
        rank that dies during the save is named on the others within its liveness interval.
        """
        final = self.path / CHECKPOINTS_DIR / f"step_{step:06d}"
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        is_writer = control.rank == 0
        if is_writer and partial.exists():
            shutil.rmtree(partial)
        control.barrier(what=f"every trainer rank before the checkpoint of step {step}")
        policy.save_checkpoint(partial)
        if is_writer:
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            state = {"step": step, "checkpoint": str(final.relative_to(self.path)), **extra}
            _replace_text(self.state_file, json.dumps(state))
        control.barrier(what=f"the checkpoint of step {step} recorded")
        return final

    def _run_files(self) -> list[str]:
        found = [name for name in (STATE_FILE, CHECKPOINTS_DIR) if (self.path / name).exists()]
        if self.metrics_file.exists() and self.metrics_file.stat().st_size > 0:
            found.append(METRICS_FILE)
        return found


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half a file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
