"""The control plane: small messages between ranks over a host (gloo) process group.

Everything that ranks must agree on outside the data path goes through :class:`ControlGroup`:
commands, results as JSON, and outcomes. Three rules hold for all of it:

- **bounded**: every wait has a timeout, and the error names what was awaited;
- **pickle-free**: only bytes and JSON travel, so a peer can at worst send data that fails to
  parse;
- **failures reach every rank**: :meth:`ControlGroup.share_outcomes` gives every rank every rank's
  :class:`Outcome`, so a failure on one rank is raised on all of them, with the failing rank's
  traceback, root causes before the timeouts they caused;
- **a dead peer is named**: with ``peers`` (a :class:`~mcore_refit.processes.PeerWatch`), every
  wait checks every ``peers.interval_s`` that the job's other processes live, and a wait that
  breaks because one died raises :class:`PeerDied` naming it first.

The waits are on the host: a rank waiting here holds no GPU kernel, so it does not slow down a
process that shares its GPU. Collectives go through the group object's own methods with group
ranks, so the group may be a ``dist.new_group(backend="gloo")`` group or a standalone
``ProcessGroupGloo`` outside the default world.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_refit.processes import Interrupted, PeerWatch, ProcessIdentity, Terminated

# Error text travels in full up to this many characters (the tail is kept: it has the cause).
MAX_ERROR_CHARS = 16384
# How a collective (gloo) or a pipe says that the process at the other end went away.
_BROKEN_CONNECTION = re.compile(r"Connection closed by peer|Connection reset by peer|"
                                r"Broken pipe")


class ControlError(RuntimeError):
    """A control-plane exchange failed: a peer died or the group broke."""


class ControlTimeout(ControlError, TimeoutError):
    """A control-plane wait expired; the message names what was awaited. A ``TimeoutError``,
    as every bounded wait's expiry is (see :func:`is_timeout`)."""


class PeerDied(ControlError):
    """A process of the job died; the message names it first (``trainer rank 1 (pid ...)``)."""


@dataclass(frozen=True)
class Outcome:
    """What one rank's part of a collective step came to: a JSON value, or an error.

    ``error`` is ``"<Type>: <message>"`` followed by the traceback; ``error_type`` the exception's
    class name. Timeouts are marked ``waited``: they are usually the consequence of another
    rank's failure, so :class:`RankFailure` names the other failures first.
    """

    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    waited: bool = False

    @classmethod
    def of(cls, action: Callable[..., Any], *args: Any, **kwargs: Any) -> Outcome:
        """Run ``action`` and capture its result, or the exception it raised (not re-raised)."""
        try:
            return cls(ok=True, value=action(*args, **kwargs))
        except Exception as error:  # shared with every rank, which all raise
            return cls.failed(error)

    @classmethod
    def failed(cls, error: BaseException) -> Outcome:
        text = "".join(traceback.format_exception(error))
        summary = f"{type(error).__name__}: {error}"
        return cls(ok=False, error=f"{summary}\n{text}"[-MAX_ERROR_CHARS:],
                   error_type=type(error).__name__, waited=is_timeout(error))

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "value": self.value, "error": self.error,
                "error_type": self.error_type, "waited": self.waited}

    @classmethod
    def from_json(cls, data: Any) -> Outcome:
        if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
            raise ControlError(f"malformed outcome on the control group: {data!r:.200}")
        return cls(ok=data["ok"], value=data.get("value"), error=data.get("error"),
                   error_type=data.get("error_type"), waited=bool(data.get("waited")))


class RankFailure(RuntimeError):
    """A collective step failed on one or more ranks; raised on every rank of the group.

    The message names the first root cause: the first failing rank that did not merely time out
    waiting for a peer, with its error and traceback. ``failures`` holds every ``(rank, error)``.
    """

    def __init__(self, what: str, failures: Sequence[tuple[int, Outcome]], *,
                 who: str | Callable[[int], str]) -> None:
        name_of = who if callable(who) else (lambda rank: f"{who} {rank}")
        ordered = sorted(failures, key=lambda item: (item[1].waited, item[0]))
        self.failures = [(rank, outcome.error) for rank, outcome in ordered]
        rank, first = ordered[0]
        others = ""
        if len(ordered) > 1:
            others = "; also failed: " + ", ".join(
                f"{name_of(r)} ({o.error_type})" for r, o in ordered[1:])
        super().__init__(f"{what} failed on {name_of(rank)}: {first.error}{others}")


class ControlGroup:
    """Bounded bytes/JSON collectives over a gloo ``group`` (``None``: the default group).

    Every method is a collective: call it on every rank of the group, in the same order (the
    point-to-point :meth:`send_json` / :meth:`recv_json` pair only the two ranks). ``timeout_s``
    bounds each wait unless a call passes its own; with ``peers``, a wait ends within
    ``peers.interval_s`` of a peer's death with :class:`PeerDied`.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout_s: float,
                 name: str = "the control group", peers: PeerWatch | None = None) -> None:
        if group is None:
            group = dist.group.WORLD
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"this process is not a member of {name}")
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout_s = timeout_s
        self.name = name
        self.peers = peers

    # --- bytes --------------------------------------------------------------------------------

    def broadcast_bytes(self, data: bytes | None, *, src: int, what: str,
                        timeout_s: float | None = None) -> bytes:
        """``data`` from group rank ``src`` on every rank (ignored elsewhere)."""
        self._check_rank(src, "src")
        is_src = self.rank == src
        if is_src and data is None:
            raise ValueError("the broadcasting rank must pass its bytes")
        length = torch.tensor([len(data) if is_src else 0], dtype=torch.int64)
        self._wait(self.group.broadcast([length], _broadcast_options(src)), what, timeout_s)
        buffer = _to_tensor(data) if is_src else torch.empty(int(length.item()),
                                                              dtype=torch.uint8)
        if buffer.numel():
            self._wait(self.group.broadcast([buffer], _broadcast_options(src)), what, timeout_s)
        return data if is_src else buffer.numpy().tobytes()

    def all_gather_bytes(self, data: bytes, *, what: str,
                         timeout_s: float | None = None) -> list[bytes]:
        """Every rank's ``data``, in group-rank order, on every rank."""
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        own = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(self.group.allgather([lengths], [own]), what, timeout_s)
        width = max(int(n.item()) for n in lengths)
        if width == 0:
            return [b"" for _ in range(self.size)]
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:len(data)] = _to_tensor(data)
        gathered = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self.group.allgather([gathered], [padded]), what, timeout_s)
        return [t[:int(n.item())].numpy().tobytes() for t, n in zip(gathered, lengths,
                                                                    strict=True)]

    # --- JSON ---------------------------------------------------------------------------------

    def broadcast_json(self, value: Any = None, *, src: int, what: str,
                       timeout_s: float | None = None) -> Any:
        data = _encode(value) if self.rank == src else None
        return _decode(self.broadcast_bytes(data, src=src, what=what, timeout_s=timeout_s), what)

    def all_gather_json(self, value: Any, *, what: str, timeout_s: float | None = None
                        ) -> list[Any]:
        return [_decode(data, what) for data in self.all_gather_bytes(
            _encode(value), what=what, timeout_s=timeout_s)]

    def send_json(self, value: Any, *, dst: int, what: str, tag: int = 0,
                  timeout_s: float | None = None) -> None:
        """Send ``value`` to group rank ``dst`` (which calls :meth:`recv_json`)."""
        self._check_rank(dst, "dst")
        data = _encode(value)
        length = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(self.group.send([length], dst, tag), what, timeout_s)
        self._wait(self.group.send([_to_tensor(data)], dst, tag), what, timeout_s)

    def recv_json(self, *, src: int, what: str, tag: int = 0,
                  timeout_s: float | None = None) -> Any:
        """The value group rank ``src`` sent with :meth:`send_json`."""
        self._check_rank(src, "src")
        length = torch.zeros(1, dtype=torch.int64)
        self._wait(self.group.recv([length], src, tag), what, timeout_s)
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        self._wait(self.group.recv([buffer], src, tag), what, timeout_s)
        return _decode(buffer.numpy().tobytes(), what)

    def send_words(self, words, *, dst: int, tag: int, what: str) -> PendingWords:
        """Start sending a few int64 ``words`` to group rank ``dst`` (a fixed-size message the
        peer receives with :meth:`recv_words`). gloo may hold a send until the peer posts its
        receive: :meth:`PendingWords.wait` before reusing what was sent."""
        self._check_rank(dst, "dst")
        tensor = torch.tensor(list(words), dtype=torch.int64)
        return PendingWords(self, self.group.send([tensor], dst, tag), tensor, what)

    def recv_words(self, count: int, *, src: int, tag: int, what: str) -> PendingWords:
        """Start receiving ``count`` int64 words from group rank ``src``; post it before the
        peer sends, so that its send completes at once."""
        self._check_rank(src, "src")
        tensor = torch.zeros(count, dtype=torch.int64)
        return PendingWords(self, self.group.recv([tensor], src, tag), tensor, what)

    def any_true(self, flag: bool, *, what: str, timeout_s: float | None = None) -> bool:
        """Whether ``flag`` is true on any rank of the group (one all-reduce of one word)."""
        if self.size == 1:
            return bool(flag)
        word = torch.tensor([int(bool(flag))], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._wait(self.group.allreduce([word], options), what, timeout_s)
        return bool(word.item())

    def barrier(self, *, what: str, timeout_s: float | None = None) -> None:
        """Wait until every rank of the group reached this call (a host wait)."""
        self.all_gather_bytes(b"", what=what, timeout_s=timeout_s)

    def watch_peers(self, *, name_of: Callable[[int], str], interval_s: float) -> PeerWatch:
        """Learn every rank's process identity and watch the others from now on (see ``peers``);
        the watch, for other groups of the same job. ``name_of(group rank)`` names a rank in
        errors. Collective."""
        rows = self.all_gather_json(ProcessIdentity.of().to_json(),
                                    what="every rank's process identity")
        self.peers = PeerWatch(peers=tuple((r, name_of(r), ProcessIdentity.from_json(row))
                                           for r, row in enumerate(rows) if r != self.rank),
                               interval_s=interval_s)
        return self.peers

    # --- outcomes -----------------------------------------------------------------------------

    def share_outcomes(self, outcome: Outcome, *, what: str,
                       who: str | Callable[[int], str] = "rank",
                       timeout_s: float | None = None) -> list[Any]:
        """Every rank's value, or :class:`RankFailure` on every rank if any rank failed.

        ``who`` names a rank in the error: a word (``"trainer rank"`` gives ``trainer rank 1``)
        or a function of the group rank.
        """
        shared = self.all_gather_json(outcome.to_json(), what=f"the outcome of {what}",
                                      timeout_s=timeout_s)
        outcomes = [Outcome.from_json(data) for data in shared]
        failures = [(rank, o) for rank, o in enumerate(outcomes) if not o.ok]
        if failures:
            raise RankFailure(what, failures, who=who)
        return [o.value for o in outcomes]

    def run_everywhere(self, what: str, action: Callable[..., Any], *args: Any,
                       who: str | Callable[[int], str] = "rank", **kwargs: Any) -> Any:
        """``action(*args, **kwargs)`` here; raise :class:`RankFailure` on every rank if it failed
        on any. Only the failures travel: the result stays local and need not be JSON."""
        outcome = Outcome.of(action, *args, **kwargs)
        self.share_outcomes(outcome if not outcome.ok else Outcome(ok=True), what=what, who=who)
        return outcome.value

    # --- internals ----------------------------------------------------------------------------

    def _wait(self, work: dist.Work, what: str, timeout_s: float | None) -> None:
        seconds = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + seconds
        try:
            while True:
                left = max(0.0, deadline - time.monotonic())
                step = left if self.peers is None else min(left, self.peers.interval_s)
                try:
                    # At least 1 ms: a zero timeout means no timeout to gloo.
                    work.wait(timeout=datetime.timedelta(seconds=max(step, 1e-3)))
                    return
                except RuntimeError as error:
                    text, expired = str(error), is_gloo_timeout(error)
                if not expired:
                    self._raise_if_peer_died(what, grace_s=1.0)
                    raise ControlError(f"{what} failed on {self.name} (rank {self.rank} of "
                                       f"{self.size}); a peer died or closed the group: "
                                       f"{text}") from None
                self._raise_if_peer_died(what)
                if time.monotonic() >= deadline:
                    raise ControlTimeout(f"timed out after {seconds:g} s waiting for {what} on "
                                         f"{self.name} (rank {self.rank} of {self.size})")
        except Terminated as stopped:
            # Raised where the slice's own timeout was being handled: that is no failure.
            stopped.__context__ = None
            if not isinstance(stopped, Interrupted):  # peers that exit then are no cause
                self._raise_if_peer_died(what, grace_s=0.5, cause=stopped)
            raise

    def _raise_if_peer_died(self, what: str, *, grace_s: float = 0.0,
                            cause: BaseException | None = None) -> None:
        dead = self.peers.first_dead(grace_s=grace_s) if self.peers is not None else None
        if dead is not None:
            raise PeerDied(f"{dead} while rank {self.rank} of {self.name} waited for "
                           f"{what}") from cause

    def _check_rank(self, rank: int, role: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"{role}={rank!r} is not a rank of {self.name} (size {self.size})")


class PendingWords:
    """A point-to-point message of int64 words in flight (see :meth:`ControlGroup.send_words`)."""

    def __init__(self, control: ControlGroup, work: dist.Work, tensor: torch.Tensor,
                 what: str) -> None:
        self._control, self._work, self._tensor, self._what = control, work, tensor, what

    def wait(self, *, timeout_s: float | None = None) -> list[int]:
        """Block until the message went (send) or arrived (receive); its words."""
        if self._work is not None:
            self._control._wait(self._work, self._what, timeout_s)
            self._work = None
        return self._tensor.tolist()


def raise_dead_peer_first(peers: PeerWatch | None, error: BaseException) -> None:
    """For a rank's outermost handler of ``error``: raise what names the root cause first, or
    return (re-raise ``error`` then).

    - an error that only followed from a broken wait or a stop (:func:`is_consequential`: a
      :class:`ControlError`, a timeout, ``Terminated``, a collective whose connection a peer
      closed) raised while this rank unwound from an error that names its cause (a
      :class:`PeerDied`, a :class:`RankFailure`, a rank's own exception) or from an
      ``Interrupted``: the earliest such; a :class:`PeerDied` raised while unwinding from an
      earlier one (or a ``RankFailure``, or an ``Interrupted``): that one;
    - otherwise, a consequential error other than ``Interrupted``: :class:`PeerDied` naming a
      dead process of the job, if one is found within half a second.

    Errors that name their cause are left as they are: after a shared failure every rank
    exits, so a peer found gone then is no cause; nor is one found after an interrupt, which
    stops every rank at once.
    """
    if not isinstance(error, PeerDied) and not is_consequential(error):
        return
    earliest, context = None, error.__context__
    while context is not None and context is not error:
        if isinstance(context, Interrupted) or (
                isinstance(context, (PeerDied, RankFailure)) if isinstance(error, PeerDied)
                else not is_consequential(context)):
            earliest = context
        context = context.__context__
    if earliest is not None:
        raise earliest from None  # its traceback, without what followed it
    if peers is None or isinstance(error, (PeerDied, Interrupted)):
        return
    dead = peers.first_dead(grace_s=0.5)
    if dead is not None:
        raise PeerDied(f"{dead}; then this rank raised {type(error).__name__}: "
                       f"{error}") from error


def is_consequential(error: BaseException) -> bool:
    """Whether ``error`` only says that a wait broke or the rank was stopped — the cause lies
    elsewhere — rather than naming what failed."""
    if isinstance(error, (PeerDied, RankFailure)):
        return False
    return (isinstance(error, (Terminated, ControlError)) or is_timeout(error)
            or _BROKEN_CONNECTION.search(str(error)) is not None)


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` says that a bounded wait expired: a ``TimeoutError`` (which
    :class:`ControlTimeout` and the refit's ``RefitTimeout`` are) or a subprocess's."""
    return isinstance(error, (TimeoutError, subprocess.TimeoutExpired))


def is_gloo_timeout(error: RuntimeError) -> bool:
    """Whether ``Work.wait(timeout)`` on a gloo group raised because the wait expired.

    torch raises a plain ``RuntimeError`` for both an expired wait and a broken peer, so its
    text is the only evidence; this is the one place that reads it. Everything above raises
    :class:`ControlTimeout` (or ``RefitTimeout``), recognised by type."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _broadcast_options(src: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = src
    return options


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _decode(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ControlError(f"{what}: the control message is not JSON ({error})") from None
