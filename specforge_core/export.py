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
from specforge_core.drafts import family_of_files
from specforge_core.runtime.checkpoint import resolve_checkpoint_dir

DTYPES = ("float32", "bfloat16", "float16")


def export(checkpoint: str, out: str, dtype: str = "keep") -> dict:
    step = resolve_checkpoint_dir(checkpoint)
    family = family_of_files(step)
    model = family.load_checkpoint_files(step)
    written = family.export(model, out, dtype=dtype)
    return {
        "checkpoint": str(step),
        "family": family.name,
        "out": str(written),
        "dtype": json.loads((written / "config.json").read_text())["torch_dtype"],
        "keys": len(model.draft_state_dict()),
        "capture_layer_ids": family.trained_layer_ids(model.config),
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
