"""The one exception a user can cause (its message is a single sentence meant for them), and
the two rules every check of a user's values uses."""

import numbers
from typing import Optional


class EagleError(Exception):
    """A bad input (path, checkpoint, flag, prompt) explained in one sentence.

    The command-line tools print the message and exit non-zero instead of
    showing a traceback.
    """


def reason(e: BaseException) -> str:
    """The first line of an exception's message (or its type name), to quote in a sentence."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check(ok: bool, message: str, param: Optional[str] = None) -> None:
    """EagleError(message) unless ok; `param`: the parameter at fault, for callers that
    report it apart (the server's error body)."""
    if not ok:
        e = EagleError(message)
        e.param = param
        raise e


def is_int(x) -> bool:
    """A whole number: Python's or NumPy's integers, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
