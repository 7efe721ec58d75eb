"""Build (or find) the prompt cache and the vocab map for a run config; print one JSON line.

    python -m specforge_core.prepare --config examples/tiny-cpu.yaml
    python -m specforge_core.prepare --config C.yaml data.max_length=1024 draft.draft_vocab_size=8000

Output (stdout, one line): ``{"prompt_cache": {"key", "path", "built", "rows": {"train", "eval"},
"dropped"}, "vocab_map": {"key", "path", "built", "coverage"}}``. Safe to run from several
processes at once (one builds, the others wait). Bad input: the message names file:line and the
fix, on stderr, and the exit code is 2.
"""

import argparse
import json
import sys

from specforge_core.config import load_config
from specforge_core.errors import SpecForgeError


def target_vocab_size(cfg, tokenizer) -> int:
    """V: rows of the target's embedding (its config's vocab_size), else the tokenizer's size."""
    from specforge_core.preflight import load_target_config

    return int(load_target_config(cfg).vocab_size) if cfg.model.target else len(tokenizer)


def prepare(cfg) -> dict:
    """ensure_prompt_cache + ensure_vocab_map for ``cfg``; returns the summary printed by main.

    :func:`~specforge_core.preflight.check_data_inputs` runs first (tokenizer vs target vocab, draft
    vocab size, a given draft.vocab_map_path), so a refused run writes nothing.
    """
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.preflight import check_data_inputs
    from specforge_core.vocab import ensure_vocab_map

    checked = check_data_inputs(cfg)
    tokenizer, V = checked.tokenizer, checked.vocab_size
    cache = ensure_prompt_cache(cfg, tokenizer)
    vm = ensure_vocab_map(cfg, cache, V)
    return {
        "prompt_cache": {
            "key": cache.key, "path": str(cache.path), "built": cache.built,
            "rows": {"train": cache.train.num_rows, "eval": cache.eval.num_rows},
            "dropped": cache.meta["dropped"],
        },
        "vocab_map": {"key": vm.key, "path": str(vm.path), "built": vm.built, "coverage": vm.coverage},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML run config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=1024")
    args = ap.parse_args(argv)
    try:
        print(json.dumps(prepare(load_config(args.config, args.overrides))), flush=True)
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
