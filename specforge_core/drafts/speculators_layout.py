"""What every family's ``--format speculators`` export shares: the release it is tested against,
the verifier's architectures read from the target's ``config.json``, the checked tensors and the
atomic write of the directory."""

import json
from pathlib import Path

from safetensors.torch import save

from specforge_core.errors import CheckpointError, ModelError
from specforge_core.io import atomic_write_bytes, atomic_write_json, staged_directory

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

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


def export_state(model, dtype: str, dtypes: dict, check_state) -> tuple[dict, object]:
    """The draft's tensors on the CPU, cast to ``dtype`` (``keep`` or a key of ``dtypes``), checked
    by the family's ``check_state(state, config, where)``, and their one floating dtype. ModelError
    for an unknown dtype or tensors of several floating dtypes; nothing is written."""
    if dtype != "keep" and dtype not in dtypes:
        raise ModelError(f"unknown export dtype {dtype!r}", where="--dtype", fix=f"use keep or one of {', '.join(dtypes)}")
    state = {}
    for key, tensor in model.draft_state_dict().items():
        if dtype != "keep" and tensor.is_floating_point():
            tensor = tensor.to(dtypes[dtype])
        state[key] = tensor.detach().to("cpu").contiguous()
    check_state(state, model.config, "draft weights")
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floats) != 1:
        raise ModelError(f"draft parameters mix dtypes {sorted(map(str, floats))}", where="draft model",
                         fix="export with --dtype bfloat16 (or float32) to cast them to one dtype")
    return state, floats.pop()


def write_layout(out: Path, tensors: dict, config: dict) -> Path:
    """``config.json`` and ``model.safetensors`` into ``out`` atomically (absent, empty or a previous
    export); CheckpointError, before writing, when ``out`` holds other files."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and {p.name for p in out.iterdir()} <= {CONFIG_FILE, WEIGHTS_FILE}):
        raise CheckpointError("the export directory holds other files", where=str(out),
                              fix="choose an empty or new --out directory")
    with staged_directory(out, replace=True) as stage:
        atomic_write_bytes(stage / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
        atomic_write_json(stage / CONFIG_FILE, config, sort_keys=True)
    return out
