"""The small exchanges around every refit, over the control plane (host waits, no device work).

- :meth:`RefitRounds.start`: every rank of the refit shows its plan fingerprint and refit index;
  a mismatch is a :class:`~mcore_refit.refit.errors.RefitError` on every rank before any byte
  moves, and every rank learns the switches (checksums, verification) of control rank 0;
- :meth:`RefitRounds.finish`: every rank's outcome; if any rank failed, every rank raises a
  ``RefitError`` naming the rank and its error (root causes before the timeouts they caused).

Both are collectives over the control group: call them on every rank of the refit, in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mcore_refit.control import (
    ControlError,
    ControlGroup,
    ControlTimeout,
    Outcome,
    PeerDied,
    RankFailure,
)
from mcore_refit.refit.errors import RefitError, RefitTimeout
from mcore_refit.refit.plan import RefitPlan


@dataclass(frozen=True)
class Switches:
    """What control rank 0 (the refit's first trainer rank) asked for in this refit."""

    refit_index: int
    checksums: bool
    verify: bool


class RefitRounds:
    """Start and finish of refits over ``control``; ``name_of(rank)`` names a control rank in
    errors (``"trainer rank 1"``, ``"inference rank 0"``)."""

    def __init__(self, control: ControlGroup, *, name_of: Callable[[int], str]) -> None:
        self._control = control
        self._name_of = name_of

    def start(self, plan: RefitPlan, *, refit_index: int, checksums: bool, verify: bool,
              timeout_s: float) -> Switches:
        """Check every rank holds ``plan``; return control rank 0's switches."""
        mine = {"fingerprint": plan.fingerprint, "refit_index": refit_index,
                "checksums": checksums, "verify": verify}
        rows = self._all_gather(mine, what=f"the start of refit {refit_index} on every rank",
                                timeout_s=timeout_s)
        fingerprints = {row["fingerprint"] for row in rows}
        if len(fingerprints) != 1:
            holders = ", ".join(f"{self._name_of(r)}: {row['fingerprint'][:16]}"
                                for r, row in enumerate(rows))
            raise RefitError(
                f"refit plan mismatch: the ranks hold different plans ({holders}); build the plan "
                "from the same weight specs and refit config on every rank, or take the "
                "sender's plan at prepare()")
        first = rows[0]
        return Switches(refit_index=first["refit_index"], checksums=first["checksums"],
                        verify=first["verify"])

    def finish(self, failure: BaseException | None, *, refit_index: int,
               timeout_s: float) -> None:
        """Share this rank's outcome; raise :class:`RefitError` everywhere if any rank failed."""
        outcome = Outcome(ok=True) if failure is None else _failed_outcome(failure)
        what = f"sharing the outcome of refit {refit_index}"
        with _refit_errors(what):
            self._control.share_outcomes(outcome, what=f"refit {refit_index}",
                                         who=self._name_of, timeout_s=timeout_s)

    def _all_gather(self, value, *, what: str, timeout_s: float) -> list:
        with _refit_errors(None):
            return self._control.all_gather_json(value, what=what, timeout_s=timeout_s)


def _failed_outcome(failure: BaseException) -> Outcome:
    """``failure`` as an outcome; a refit error's own message names the failed step (and its
    cause), so it goes first without its type's name, then the traceback."""
    outcome = Outcome.failed(failure)
    if isinstance(failure, RefitError) and outcome.error is not None:
        error = outcome.error.removeprefix(f"{type(failure).__name__}: ")
        outcome = dataclasses.replace(outcome, error=error)
    return outcome


@contextmanager
def _refit_errors(what: str | None) -> Iterator[None]:
    """Control-plane failures as refit errors, by type: a rank's failure is a
    :class:`RefitError`, an expired wait a :class:`RefitTimeout`; a dead peer stays
    :class:`~mcore_refit.control.PeerDied` (it names the dead rank first)."""
    prefix = f"{what}: " if what else ""
    try:
        yield
    except RankFailure as error:
        raise RefitError(str(error)) from None
    except PeerDied:
        raise
    except ControlTimeout as error:
        raise RefitTimeout(f"{prefix}{error}") from None
    except ControlError as error:
        raise RefitError(f"{prefix}{error}") from None
