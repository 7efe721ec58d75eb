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
from specforge_core.errors import ModelError, SpecForgeError


def target_vocab_size(cfg, tokenizer) -> int:
    """V: rows of the target's embedding (its config's vocab_size), else the tokenizer's size."""
    from transformers import AutoConfig

    if not cfg.model.target:
        return len(tokenizer)
    kwargs = {"trust_remote_code": cfg.model.trust_remote_code}
    if cfg.model.gguf_file:
        kwargs["gguf_file"] = cfg.model.gguf_file
    try:
        tc = AutoConfig.from_pretrained(cfg.model.target, **kwargs).get_text_config()
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the target config: {e}", where="model.target",
                         fix="point model.target at a Hugging Face model directory") from None
    return int(tc.vocab_size)


def prepare(cfg) -> dict:
    """ensure_prompt_cache + ensure_vocab_map for ``cfg``; returns the summary printed by main."""
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.vocab import ensure_vocab_map

    tokenizer = load_tokenizer(cfg)
    cache = ensure_prompt_cache(cfg, tokenizer)
    vm = ensure_vocab_map(cfg, cache, target_vocab_size(cfg, tokenizer))
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
