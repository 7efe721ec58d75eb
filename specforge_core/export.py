"""Export a trained draft as the directory SGLang and vLLM serve.

    python -m specforge_core.export --checkpoint runs/demo --out drafts/demo             # newest checkpoint
    python -m specforge_core.export --checkpoint runs/demo/checkpoints/step-00000012 --out d --dtype bfloat16

Reads only the draft files of a checkpoint step directory (a run directory resolves through
``checkpoints/latest``) and writes ``config.json`` + ``model.safetensors`` holding exactly the
serving keys; a missing, unexpected or misshapen key is refused before anything is written.
Prints one JSON line: checkpoint, out, dtype, number of keys, capture layer ids. docs/export.md.
"""

import json
import sys

from specforge_core.cli import command_parser, run_command
from specforge_core.drafts.eagle3.serving import (
    DTYPES, EXPORT_CONFIG, export_draft, load_draft_from_files, resolve_checkpoint_dir,
)
from specforge_core.drafts.eagle3.config import capture_layer_ids_of


def export(checkpoint: str, out: str, dtype: str = "keep") -> dict:
    step = resolve_checkpoint_dir(checkpoint)
    model = load_draft_from_files(step)
    written = export_draft(model, out, dtype=dtype)
    return {
        "checkpoint": str(step),
        "out": str(written),
        "dtype": json.loads((written / EXPORT_CONFIG).read_text())["torch_dtype"],
        "keys": len(model.draft_state_dict()),
        "capture_layer_ids": capture_layer_ids_of(model.config),
    }


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.export", config=False)
    ap.add_argument("--checkpoint", required=True, help="checkpoint step directory or run directory")
    ap.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    ap.add_argument("--dtype", default="keep", choices=["keep", *DTYPES], help="weights dtype (default: as trained)")
    args = ap.parse_args(argv)
    return run_command(lambda: export(args.checkpoint, args.out, args.dtype))


if __name__ == "__main__":
    sys.exit(main())
