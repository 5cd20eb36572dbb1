"""The one exception a user can cause: its message is a single sentence meant for them."""


class EagleError(Exception):
    """A bad input (path, checkpoint, flag, prompt) explained in one sentence.

    The command-line tools print the message and exit non-zero instead of
    showing a traceback.
    """


def reason(e: BaseException) -> str:
    """The first line of an exception's message (or its type name), to quote in a sentence."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
