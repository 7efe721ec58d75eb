"""What every family's ``--format speculators`` export shares: the release it is tested against and
the verifier's architectures read from the target's ``config.json``."""

import json
from pathlib import Path

from specforge_core.errors import ModelError

SPECULATORS_VERSION = "0.9.0"  # the speculators release these layouts are tested against


def target_architectures(target_dir: Path) -> list[str]:
    """The target's ``config.json`` ``architectures`` (the verifier a speculators config names);
    ModelError naming the file and the fix when it is unreadable or names none."""
    path = Path(target_dir) / "config.json"
    try:
        architectures = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read the target's config ({e})", where=str(path),
                         fix="give --target the local Hugging Face directory of the target the draft was trained on") from None
    if not architectures:
        raise ModelError("the target's config names no architectures", where=f"{path}: architectures",
                         fix="give --target a Hugging Face model directory whose config.json has architectures")
    return list(architectures)
