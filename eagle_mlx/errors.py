"""The one exception a user can cause: its message is a single sentence meant for them."""


class EagleError(Exception):
    """A bad input (path, checkpoint, flag, prompt) explained in one sentence.

    The command-line tools print the message and exit non-zero instead of
    showing a traceback.
    """
