"""What every command-line tool shares: user errors end in one sentence, never a traceback."""

import sys

from .errors import EagleError


class UsageError(EagleError):
    """A bad flag value: exit code 2, as argparse uses for usage errors."""


def run_cli(main, argv=None) -> int:
    """Run main(argv); an EagleError prints its sentence and exits 1 (2 for usage errors)."""
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except EagleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
