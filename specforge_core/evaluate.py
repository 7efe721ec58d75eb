"""Measure a trained draft's acceptance length by real speculative decoding on held-out prompts.

    python -m specforge_core.evaluate --config examples/tiny-cpu.yaml --draft runs/tiny
    python -m specforge_core.evaluate --config C.yaml --draft drafts/exported --num-steps 3 \
        --max-new-tokens 128 --prompts 32 [--batch-size 8] [--check-lossless] [--report R.md] [--run-dir RUN]

``--draft`` is a run directory (its newest checkpoint), a checkpoint step directory, or an
exported SGLang/vLLM directory. Prompts are the first ``--prompts`` rows of the prompt cache's
``eval`` split (never trained on). Prints one JSON line with the measured numbers
(docs/validation.md defines them) and writes a markdown report (default
``<output.dir>/validation.md``) with the simulated acceptance length from the run's training
metrics beside the measured one (``specforge_core/decoding/evaluation.py``).
"""

import sys

from specforge_core.cli import command_parser, load_run_config, run_command
from specforge_core.decoding.evaluation import evaluate


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.evaluate", overrides_example="capture.device=cpu")
    ap.add_argument("--draft", required=True, help="run dir, checkpoint step dir, or exported draft dir")
    ap.add_argument("--num-steps", type=int, help="draft tokens per verify round (default validation.num_steps)")
    ap.add_argument("--max-new-tokens", type=int, help="default validation.max_new_tokens")
    ap.add_argument("--prompts", type=int, help="held-out prompts to decode (default validation.num_prompts)")
    ap.add_argument("--report", help="markdown report path (default <output.dir>/validation.md)")
    ap.add_argument("--run-dir", help="run directory with metrics.jsonl (default output.dir)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (each as if alone)")
    ap.add_argument("--check-lossless", action="store_true", help="also decode without the draft and compare")
    args = ap.parse_args(argv)
    return run_command(lambda: evaluate(
        load_run_config(args), args.draft, num_steps=args.num_steps, max_new_tokens=args.max_new_tokens,
        num_prompts=args.prompts, report_path=args.report, run_dir=args.run_dir,
        batch_size=args.batch_size, check_lossless=args.check_lossless))


if __name__ == "__main__":
    sys.exit(main())
