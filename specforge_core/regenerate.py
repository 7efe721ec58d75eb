"""Answer a dataset's prompts with the target itself: drafts train best on the target's own outputs.

    python -m specforge_core.regenerate --config examples/smollm2-cpu.yaml --out data/regen.jsonl
    python -m specforge_core.regenerate --config C.yaml --out regen.jsonl --temperature 0.7 --top-p 0.9
    python -m specforge_core.regenerate --config C.yaml --out regen.jsonl --engine sglang --batch-size 512  # GPU

Each answered conversation is appended to ``--out`` in the conversation format the data stage
reads; ids already there are skipped, so an interrupted run continues where it stopped. Prints
one JSON line with the counts and throughput (``specforge_core/decoding/answering.py``).
"""

import sys

from specforge_core.system.host import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch is imported: decoding on busy cores is several times faster with it
from pathlib import Path

from specforge_core.cli import command_parser, run_command
from specforge_core.config import load_config
from specforge_core.drafts import check_config
from specforge_core.decoding.answering import regenerate


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.regenerate", overrides_example="model.dtype=bfloat16")
    ap.add_argument("--out", required=True, help="JSONL to append answered conversations to")
    ap.add_argument("--input", action="append", help="source file(s) instead of data.train_files")
    ap.add_argument("--engine", choices=["hf", "sglang"], default="hf",
                    help="hf: transformers (any device); sglang: an in-process SGLang engine (GPU; capture.sglang's settings)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per call (and per write); give sglang hundreds")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="answer at most this many pending prompts")
    args = ap.parse_args(argv)
    return run_command(lambda: regenerate(
        check_config(load_config(args.config, args.overrides)), Path(args.out), files=args.input, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, limit=args.limit, engine=args.engine))


if __name__ == "__main__":
    sys.exit(main())
