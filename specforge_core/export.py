"""Export a trained draft as the directory SGLang and vLLM serve.

    python -m specforge_core.export --checkpoint runs/demo --out drafts/demo             # newest checkpoint
    python -m specforge_core.export --checkpoint runs/demo/checkpoints/step-00000012 --out d --dtype bfloat16
    python -m specforge_core.export --checkpoint runs/demo --out drafts/demo-vllm --format speculators \\
        --target models/target [--verifier meta-llama/Llama-3.1-8B-Instruct] [--speculative-tokens 3]

Reads only the draft files of a checkpoint step directory (a run directory resolves through
``checkpoints/latest``). ``--format sglang`` (the default) writes ``config.json`` +
``model.safetensors`` holding exactly the serving keys, which SGLang and vLLM both load; a
missing, unexpected or misshapen key is refused before anything is written. ``--format
speculators`` writes vLLM's native speculators layout of the draft's family (it names the verifier
and the speculative tokens, so ``vllm serve DIR`` needs nothing else); it reads the target's
embedding and architectures from ``--target``. Prints one JSON line: checkpoint, family, format,
out, dtype, number of tensors, capture layer ids. docs/export.md.
"""

import json
import sys

from safetensors import safe_open

from specforge_core.cli import command_parser, run_command
from specforge_core.drafts import family_of_files
from specforge_core.errors import ConfigError
from specforge_core.loop.checkpoint import resolve_checkpoint_dir

DTYPES = ("float32", "bfloat16", "float16")
EXPORT_FORMATS = ("sglang", "speculators")


def export(checkpoint: str, out: str, dtype: str = "keep", *, fmt: str = "sglang", target: str | None = None,
           verifier: str | None = None, speculative_tokens: int | None = None) -> dict:
    """Export the draft of ``checkpoint`` to ``out`` in format ``fmt``; the command's JSON line.

    ``target``, ``verifier`` and ``speculative_tokens`` belong to the speculators format (ConfigError
    naming the flag when given for another format, or when ``target`` is missing for it).
    """
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}", where="--format", fix=f"use one of {', '.join(EXPORT_FORMATS)}")
    speculators_only = {"--target": target, "--verifier": verifier, "--speculative-tokens": speculative_tokens}
    if fmt == "sglang" and (given := [flag for flag, value in speculators_only.items() if value is not None]):
        raise ConfigError(f"{', '.join(given)} only apply to --format speculators", where=given[0],
                          fix="add --format speculators, or drop " + ", ".join(given))
    if fmt == "speculators" and target is None:
        raise ConfigError("the speculators format copies the target's embedding and names its architectures",
                          where="--target", fix="give --target the local directory of the target the draft was trained on")
    step = resolve_checkpoint_dir(checkpoint)
    family = family_of_files(step)
    model = family.load_checkpoint_files(step)
    result = {"checkpoint": str(step), "family": family.name, "format": fmt}
    if fmt == "sglang":
        written = family.export(model, out, dtype=dtype)
        tensors = len(model.draft_state_dict())
    else:
        tokens = {} if speculative_tokens is None else {"speculative_tokens": speculative_tokens}
        written = family.export_speculators(model, out, target_dir=target, verifier=verifier, dtype=dtype, **tokens)
        config = json.loads((written / "config.json").read_text())
        with safe_open(str(written / "model.safetensors"), framework="pt") as f:
            tensors = len(list(f.keys()))  # EAGLE3's carries the target's embedding too
        result.update(verifier=config["speculators_config"]["verifier"]["name_or_path"],
                      speculative_tokens=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
                      vllm_layer_ids=config.get("eagle_aux_hidden_state_layer_ids", config.get("aux_hidden_state_layer_ids")))
    result.update(out=str(written), dtype=json.loads((written / "config.json").read_text())["torch_dtype"],
                  keys=tensors, capture_layer_ids=family.trained_layer_ids(model.config))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.export", config=False)
    ap.add_argument("--checkpoint", required=True, help="checkpoint step directory or run directory")
    ap.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    ap.add_argument("--dtype", default="keep", choices=["keep", *DTYPES], help="weights dtype (default: as trained)")
    ap.add_argument("--format", default="sglang", choices=EXPORT_FORMATS,
                    help="sglang (default; SGLang and vLLM load it) or speculators (vLLM's native layout; every family)")
    ap.add_argument("--target", help="speculators: the local target directory (embedding, architectures)")
    ap.add_argument("--verifier", help="speculators: the target's name or path written into the config "
                    "(default: --target)")
    ap.add_argument("--speculative-tokens", type=int, help="speculators: vLLM's num_speculative_tokens (default 3)")
    args = ap.parse_args(argv)
    return run_command(lambda: export(args.checkpoint, args.out, args.dtype, fmt=args.format, target=args.target,
                                      verifier=args.verifier, speculative_tokens=args.speculative_tokens))


if __name__ == "__main__":
    sys.exit(main())
