"""What every command-line tool shares: user errors end in one sentence, never a traceback."""

import sys

from .errors import EagleError


def run_cli(main, argv=None) -> int:
    """Run main(argv); an EagleError prints its sentence and exits 1 (argparse exits 2)."""
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except EagleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
