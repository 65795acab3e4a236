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
to the run directory, so a copied or moved run resumes from its own checkpoints. The newest
``keep`` complete checkpoints stay; a latest one whose files are damaged (a shard cut short, an
index missing) is passed over for the one before, with a warning naming the broken file.

Which runs may use a directory (the lock, :mod:`.runlock`, has made sure no other run is live):

- a fresh run: one that holds no checkpoint (empty, or left by a run that crashed before its
  first save: its metrics rows, events and partial checkpoints are replaced, and the log says
  so); a directory with a checkpoint needs ``--resume``;
- ``--resume``: the latest readable checkpoint; with no checkpoint at all the run starts over
  at step 0 (said in the log), like a fresh one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_refit.control import ControlGroup
from mcore_refit.files import CorruptFile, check_distributed_checkpoint, replace_text, writing

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
PARTIAL_SUFFIX = ".partial"
_CHECKPOINT_NAME = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class RunState:
    """What ``trainer_state.json`` records about the latest complete checkpoint."""

    step: int
    # Absolute, resolved against the run directory it was read from.
    checkpoint: Path
    # Anything else the loop stored beside it (e.g. the optimizer settings).
    extra: dict[str, Any] = field(default_factory=dict)
    # Why a later checkpoint was passed over for this one (its broken file), if one was.
    passed_over: str | None = None


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
        """Check that this run may use the directory (module docstring); return the state to
        resume from, None for a run that starts at step 0.

        A resumed run gets the latest checkpoint whose files are whole, at a step below
        ``steps``. Reads only: safe to call on every rank before any rank writes.
        """
        if not resume:
            if self.has_checkpoint():
                raise ValueError(
                    f"run.output_dir {str(self.path)!r} already holds a run "
                    f"({', '.join(self._run_files())}); pass --resume to continue it, or "
                    "choose another run.output_dir")
            return None
        if not self.has_checkpoint():
            return None
        state = self.readable(self.read_state())
        if steps <= state.step:
            raise ValueError(
                f"--resume: run.steps={steps} but the checkpoint in {str(self.path)!r} is at step "
                f"{state.step}; set run.steps above {state.step} to train further")
        return state

    def has_checkpoint(self) -> bool:
        """Whether a run saved a checkpoint here (a state file, or a complete checkpoint)."""
        return self.state_file.exists() or bool(self.complete_checkpoints())

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, directory)`` of every complete (renamed) checkpoint, newest first."""
        found = []
        for path in (self.path / CHECKPOINTS_DIR).glob("step_*"):
            match = _CHECKPOINT_NAME.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def readable(self, state: RunState) -> RunState:
        """``state``, or, when its checkpoint's files are damaged, the newest earlier complete
        checkpoint whose files are whole (``passed_over`` says why); raises ``ValueError``
        naming every broken file when none is."""
        broken = []
        candidates = [(state.step, state.checkpoint)] + [
            (step, path) for step, path in self.complete_checkpoints() if step < state.step]
        for step, path in candidates:
            try:
                check_distributed_checkpoint(path)
            except CorruptFile as error:
                broken.append(str(error))
                continue
            if not broken:
                return state
            return RunState(step=step, checkpoint=path, extra=state.extra,
                            passed_over="; ".join(broken))
        raise ValueError(f"--resume: no readable checkpoint in {str(self.path)!r}: "
                         f"{'; '.join(broken)}; restore the files, or start a new run")

    def leftovers(self) -> list[str]:
        """What a run that saved no checkpoint left here, which a run starting at step 0
        replaces (for the log)."""
        found = []
        if self.metrics_file.exists() and self.metrics_file.stat().st_size > 0:
            rows = len(self.metrics_file.read_text().splitlines())
            found.append(f"{METRICS_FILE} ({rows} rows)")
        found += [f"{CHECKPOINTS_DIR}/{p.name}"
                  for p in sorted(self.path.glob(f"{CHECKPOINTS_DIR}/*{PARTIAL_SUFFIX}"))]
        found += [name for name in ("tensorboard", "config.yaml", "metrics.png")
                  if (self.path / name).exists()]
        return found

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

    def prepare_resume(self, state: RunState | None) -> None:
        """Forget everything after ``state`` (None: everything, for a run that starts over):
        metrics rows of later steps, partial checkpoints.

        Call on one rank (the logging rank) before the resumed run writes anything.
        """
        last_step = state.step if state is not None else 0
        if self.metrics_file.exists():
            kept = []
            for line in self.metrics_file.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a row cut short by a killed process
                if isinstance(row, dict) and isinstance(row.get("step"), int) \
                        and row["step"] <= last_step:
                    kept.append(line)
            replace_text(self.metrics_file, "".join(f"{line}\n" for line in kept))
        for partial in self.path.glob(f"{CHECKPOINTS_DIR}/*{PARTIAL_SUFFIX}"):
            shutil.rmtree(partial)

    def save_checkpoint(self, policy, *, step: int, extra: dict[str, Any],
                        control: ControlGroup, keep: int | None = None) -> Path:
        """Save ``policy`` as the checkpoint of ``step`` and record it as the latest; then remove
        all but the newest ``keep`` complete checkpoints up to ``step`` (None keeps every one).

        Collective over the trainer ranks, whose host group ``control`` is (its rank 0 renames
        and records). The state file changes only after every rank has written its shards and
        the directory has its final name. The ranks wait for each other on ``control``, so a
        rank that dies during the save is named on the others within its liveness interval; a
        failed write (a full disk: ``no space left on device writing PATH``) is raised on every
        rank.
        """
        final = self.path / CHECKPOINTS_DIR / f"step_{step:06d}"
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        is_writer = control.rank == 0
        if is_writer and partial.exists():
            shutil.rmtree(partial)
        control.barrier(what=f"every trainer rank before the checkpoint of step {step}")
        control.run_everywhere(f"the checkpoint of step {step}", _save, policy, partial,
                               who="trainer rank")
        if is_writer:
            if final.exists():
                logger.warning("replacing %s, an earlier attempt's checkpoint of step %d", final,
                               step)
                shutil.rmtree(final)
            os.replace(partial, final)
            state = {"step": step, "checkpoint": str(final.relative_to(self.path)), **extra}
            replace_text(self.state_file, json.dumps(state))
            if keep is not None:
                # Those of later steps (an earlier attempt's) are replaced when reached.
                done = [path for saved, path in self.complete_checkpoints() if saved <= step]
                for old in done[keep:]:
                    logger.info("removing %s (run.keep_checkpoints=%d)", old, keep)
                    shutil.rmtree(old)
        control.barrier(what=f"the checkpoint of step {step} recorded")
        return final

    def _run_files(self) -> list[str]:
        found = [name for name in (STATE_FILE, CHECKPOINTS_DIR) if (self.path / name).exists()]
        if self.metrics_file.exists() and self.metrics_file.stat().st_size > 0:
            found.append(METRICS_FILE)
        return found


def _save(policy, path: Path) -> None:
    """One rank's part of a checkpoint save; a failed write names the checkpoint's path."""
    from torch.distributed.checkpoint.api import CheckpointException

    with writing(path):
        try:
            policy.save_checkpoint(path)
        except CheckpointException as error:
            # A BaseException, raised on every rank when any rank's write failed.
            raise RuntimeError(f"writing the checkpoint {path} failed: {error}") from error
