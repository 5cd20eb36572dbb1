"""Local folder or Hugging Face repo id -> local folder, with errors a user can act on."""

import os
from pathlib import Path
from typing import Optional, Sequence

from .errors import EagleError, reason


def resolve(path_or_repo: str, what: str = "model",
            allow_patterns: Optional[Sequence[str]] = None) -> Path:
    """Return a local folder for `path_or_repo`, downloading a Hub repo if needed.

    Offline (HF_HUB_OFFLINE=1) a repo id resolves only from the local Hub cache.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise EagleError(f"{what} path {path} is a file, not a folder.")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(str(path_or_repo))
    except HFValidationError:
        raise EagleError(f"{what} folder {path} does not exist.") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(str(path_or_repo), allow_patterns=allow_patterns))
    except Exception as e:  # the hub raises many kinds: network, auth, missing repo
        if offline:
            raise EagleError(
                f"{what} '{path_or_repo}' is neither a local folder nor in the Hugging Face "
                "cache, and HF_HUB_OFFLINE=1 forbids downloading it."
            ) from None
        raise EagleError(
            f"{what} '{path_or_repo}' is not a local folder and could not be downloaded "
            f"from the Hugging Face Hub ({reason(e)})."
        ) from None
