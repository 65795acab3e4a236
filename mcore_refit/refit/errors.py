"""The refit's errors: one type for a failed refit, one for a bounded wait that expired.

Raised on every participating rank (a failure on one end reaches both ends); callers catch them
by type, never by their message text. :func:`failed` builds the error a rank records for a step
that failed, so the refit's outcome exchange can raise it everywhere.
"""


class RefitError(RuntimeError):
    """A refit failed. Raised on every participating rank; the engine's weights may be partial."""


class RefitTimeout(RefitError, TimeoutError):
    """A bounded wait inside a refit expired; the message names what was awaited. Also a
    ``TimeoutError``, so code that knows nothing of refits recognises it by type."""


def failed(what: str, cause: BaseException) -> RefitError:
    """The :class:`RefitError` of ``what``, which failed because of ``cause``.

    Its message ends with the cause's type and message (what travels to the other ranks and to
    the engine), and ``cause`` stays attached, with its traceback. A rank records such an error
    rather than raising it at once when it must keep taking part in the refit's exchanges.
    """
    error = RefitError(f"{what}: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error
