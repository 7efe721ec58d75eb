"""Measure a trained draft's acceptance length by real speculative decoding: held-out prompts, or benchmarks.

    python -m specforge_core.evaluate --config examples/tiny-cpu.yaml --draft runs/tiny
    python -m specforge_core.evaluate --config C.yaml --draft drafts/exported --num-steps 3 \\
        --max-new-tokens 128 --prompts 32 [--batch-size 8] [--check-lossless] [--report R.md] [--run-dir RUN]
    python -m specforge_core.evaluate --config C.yaml --draft DIR --benchmarks mt-bench,humaneval,sharegpt[,FILE] \\
        [--settings 3,1,4 7,1,8] [--limit 80] [--max-new-tokens 128] [--report R.md]

``--draft`` is a run directory (its newest checkpoint), a checkpoint step directory, or an
exported SGLang/vLLM directory. Without ``--benchmarks``, prompts are the first ``--prompts``
rows of the prompt cache's ``eval`` split (never trained on); the markdown report (default
``<output.dir>/validation.md``) puts the simulated acceptance length from the run's training
metrics beside the measured one. With ``--benchmarks``, each named prompt set (or file) is
decoded at each setting (steps,topk,draft_tokens; default ``validation.settings``) and plainly,
and the table goes to ``<output.dir>/benchmarks.md``; a progress bar over requests goes to
stderr. Either way one JSON line with the numbers is printed (docs/validation.md defines them;
``specforge_core/decoding/evaluation.py``).
"""

import sys

from specforge_core.system.host import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch is imported: decoding on busy cores is several times faster with it

from pydantic import ValidationError

from specforge_core.cli import command_parser, run_command
from specforge_core.config import load_config
from specforge_core.drafts import check_config
from specforge_core.decoding.evaluation import evaluate, evaluate_benchmarks
from specforge_core.errors import ConfigError


def parse_setting(text: str):
    """``"3,1,4"`` → ``config.BenchmarkSetting(steps=3, topk=1, draft_tokens=4)`` (its checks apply)."""
    from specforge_core.config import BenchmarkSetting

    try:
        steps, topk, draft_tokens = (int(x) for x in text.split(","))
        return BenchmarkSetting(steps=steps, topk=topk, draft_tokens=draft_tokens)
    except ValueError as e:  # pydantic's ValidationError is a ValueError too
        detail = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors()) \
            if isinstance(e, ValidationError) else "not three integers"
        raise ConfigError(f"setting {text!r}: {detail}", where="--settings",
                          fix="write each setting as steps,topk,draft_tokens, e.g. 3,1,4 7,1,8") from None


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.evaluate", overrides_example="capture.device=cpu")
    ap.add_argument("--draft", required=True, help="run dir, checkpoint step dir, or exported draft dir")
    ap.add_argument("--num-steps", type=int, help="draft tokens per verify round (default validation.num_steps)")
    ap.add_argument("--max-new-tokens", type=int, help="per prompt or turn; default validation.max_new_tokens")
    ap.add_argument("--prompts", type=int, help="held-out prompts to decode (default validation.num_prompts)")
    ap.add_argument("--report", help="markdown report path (default <output.dir>/validation.md or benchmarks.md)")
    ap.add_argument("--run-dir", help="run directory with metrics.jsonl and run.json (default output.dir)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (each as if alone)")
    ap.add_argument("--check-lossless", action="store_true", help="also decode without the draft and compare")
    ap.add_argument("--benchmarks", help="comma-separated: mt-bench, humaneval, sharegpt, or prompt files")
    ap.add_argument("--settings", nargs="+", metavar="S,K,N",
                    help="with --benchmarks: steps,topk,draft_tokens rows (default validation.settings)")
    ap.add_argument("--limit", type=int, help="with --benchmarks: the first N prompts of each "
                    "(default validation.benchmark_prompts, else all)")
    args = ap.parse_args(argv)

    def body():
        cfg = check_config(load_config(args.config, args.overrides))
        if args.benchmarks is None:
            if args.settings or args.limit is not None:
                raise ConfigError("--settings and --limit apply to benchmarks", where="--benchmarks",
                                  fix="add --benchmarks mt-bench,... or drop --settings / --limit")
            return evaluate(cfg, args.draft, num_steps=args.num_steps, max_new_tokens=args.max_new_tokens,
                            num_prompts=args.prompts, report_path=args.report, run_dir=args.run_dir,
                            batch_size=args.batch_size, check_lossless=args.check_lossless)
        if args.num_steps is not None or args.prompts is not None or args.check_lossless:
            raise ConfigError("--num-steps, --prompts and --check-lossless are for the held-out figure",
                              where="--benchmarks", fix="give the benchmark rows with --settings and the "
                              "prompt count with --limit; the table always counts outputs that differ from greedy")
        names = [n.strip() for n in args.benchmarks.split(",") if n.strip()]
        settings = [parse_setting(s) for s in args.settings] if args.settings else None
        return evaluate_benchmarks(cfg, args.draft, benchmarks=names, settings=settings, limit=args.limit,
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   report_path=args.report, run_dir=args.run_dir, progress=True)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
