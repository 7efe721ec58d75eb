"""Build (or find) the prompt cache and the vocab map for a run config; print one JSON line.

    python -m specforge_core.prepare --config examples/tiny-cpu.yaml
    python -m specforge_core.prepare --config C.yaml data.max_length=1024 draft.draft_vocab_size=8000

Output (stdout, one line): ``{"target": {"fingerprint"}, "prompt_cache": {"key", "path", "built", "rows": {"train", "eval"},
"dropped"}, "vocab_map": {"key", "path", "built", "coverage"}}`` (``vocab_map`` null for a draft family
that uses the full target vocabulary, DFlash). Safe to run from several
processes at once (one builds, the others wait). Bad input: the message names file:line and the
fix, on stderr, and the exit code is 2. The target's fingerprint (the sha256 of its files, which
resume compares) is computed here once and remembered, so the ranks only re-check it.
"""

import sys

from specforge_core.cli import command_parser, run_command
from specforge_core.config import load_config
from specforge_core.drafts import check_config


def prepare(cfg) -> dict:
    """ensure_prompt_cache + ensure_vocab_map for ``cfg``; returns the summary printed by main.

    :func:`~specforge_core.launch.preflight.check_data_inputs` runs first (tokenizer vs target vocab, draft
    vocab size, a given draft.vocab_map_path), so a refused run writes nothing.
    """
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.launch.preflight import check_data_inputs
    from specforge_core.data.vocab import ensure_vocab_map
    from specforge_core.loop.trainer import directory_identity, target_memo_dir

    checked = check_data_inputs(cfg)
    tokenizer, V = checked.tokenizer, checked.vocab_size
    cache = ensure_prompt_cache(cfg, tokenizer)
    vm = ensure_vocab_map(cfg, cache, V) if checked.family.uses_vocab_map else None
    return {
        "target": {"fingerprint": directory_identity(cfg.model.target, memo_dir=target_memo_dir(cfg))},
        "prompt_cache": {
            "key": cache.key, "path": str(cache.path), "built": cache.built,
            "rows": {"train": cache.train.num_rows, "eval": cache.eval.num_rows},
            "dropped": cache.meta["dropped"],
        },
        "vocab_map": None if vm is None else {"key": vm.key, "path": str(vm.path), "built": vm.built,
                                              "coverage": vm.coverage},
    }


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.prepare", overrides_example="data.max_length=1024")
    args = ap.parse_args(argv)
    return run_command(lambda: prepare(check_config(load_config(args.config, args.overrides))))


if __name__ == "__main__":
    sys.exit(main())
