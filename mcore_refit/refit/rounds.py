"""The small exchanges around every refit, over the control plane (host waits, no device work).

- :meth:`RefitRounds.start`: every rank of the refit shows its plan fingerprint and refit index;
  a mismatch is a :class:`~mcore_refit.refit.transport.RefitError` on every rank before any byte
  moves, and every rank learns the switches (checksums, verification) of control rank 0;
- :meth:`RefitRounds.finish`: every rank's outcome; if any rank failed, every rank raises a
  ``RefitError`` naming the rank and its error (root causes before the timeouts they caused).

Both are collectives over the control group: call them on every rank of the refit, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mcore_refit.control import ControlError, ControlGroup, Outcome, PeerDied, RankFailure
from mcore_refit.refit.plan import RefitPlan
from mcore_refit.refit.transport import RefitError, RefitTimeout

FLAG_CHECKSUMS = 1
FLAG_VERIFY = 2


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

    def finish(self, failure: BaseException | str | None, *, refit_index: int,
               timeout_s: float) -> None:
        """Share this rank's outcome; raise :class:`RefitError` everywhere if any rank failed."""
        if failure is None:
            outcome = Outcome(ok=True)
        elif isinstance(failure, BaseException):
            outcome = Outcome.failed(failure)
        else:
            outcome = Outcome(ok=False, error=failure, error_type="RefitError")
        try:
            self._control.share_outcomes(outcome, what=f"refit {refit_index}",
                                         who=self._name_of, timeout_s=timeout_s)
        except RankFailure as error:
            raise RefitError(str(error)) from None
        except PeerDied:
            raise  # names the dead rank first as it is
        except ControlError as error:
            kind = RefitTimeout if "timed out" in str(error) else RefitError
            raise kind(f"sharing the outcome of refit {refit_index}: {error}") from None

    def _all_gather(self, value, *, what: str, timeout_s: float) -> list:
        try:
            return self._control.all_gather_json(value, what=what, timeout_s=timeout_s)
        except PeerDied:
            raise
        except ControlError as error:
            kind = RefitTimeout if "timed out" in str(error) else RefitError
            raise kind(str(error)) from None

