"""The demo pair shipped inside the package: used when no --model is given."""

from pathlib import Path

from .errors import EagleError

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_NOTE = "default: the demo target shipped with eagle_mlx"


def demo_paths():
    """(target folder, head folder) of the shipped demo pair."""
    target, head = DEMO_DIR / "target", DEMO_DIR / "head"
    if not (target / "config.json").is_file():
        raise EagleError(f"no --model given and the demo model is not installed in {DEMO_DIR}.")
    return str(target), (str(head) if (head / "config.json").is_file() else None)
