"""Data-preparation benchmark: prompt-cache build against the tokenizer's own throughput.

    SPECFORGE_MODEL_CACHE=.cache/models python bench/data_prep.py            # 20k rows, SmolLM2 (minutes)
    python bench/data_prep.py --rows 200 --target DIR                       # quick run, any HF dir

Writes ``--rows`` real conversations (chitchat-dataset, joined to about 1.4k SmolLM2 tokens each),
then measures in one process:

1. tokenizer floor: one batched ``tokenizer(texts, return_offsets_mapping=True)`` call over the
   rendered texts (rendering not timed): the speed the tokenizer itself allows; also the same
   call made per 256-row chunk (one giant call pays for millions of Python offset tuples);
2. cold build: ``ensure_prompt_cache`` on an empty cache directory (hash + read + render +
   tokenize + masks + Arrow write);
3. hit: ``ensure_prompt_cache`` again (key + open);
4. vocab map: ``ensure_vocab_map`` (counts streamed from the Arrow cache, top-Vd), then its hit.

Prints a Markdown table and one JSON line with the numbers.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specforge_core.config import config_from_dict  # noqa: E402
from specforge_core.data.formats import iter_records  # noqa: E402
from specforge_core.data.prompt_cache import ensure_prompt_cache  # noqa: E402
from fixtures.chitchat import write_chitchat_jsonl  # noqa: E402
from specforge_core.data.tokenize import ChatRenderer, load_tokenizer  # noqa: E402
from specforge_core.capture.target_info import target_vocab_size  # noqa: E402
from specforge_core.data.vocab import ensure_vocab_map  # noqa: E402


def timed_call(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def tokenize_in_chunks(tok, texts: list[str], size: int) -> None:
    for i in range(0, len(texts), size):
        tok(texts[i : i + size], return_offsets_mapping=True)  # result dropped: no pile-up of objects


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--min-chars", type=int, default=2800, help="≈1.4k SmolLM2 tokens per conversation")
    ap.add_argument("--target", help="HF model dir (default: SmolLM2-135M-Instruct via ensure_smollm2)")
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--workdir", help="keep data and caches here (default: a temp dir)")
    args = ap.parse_args(argv)

    if args.target is None:
        from fixtures.smollm2 import ensure_smollm2

        args.target = str(ensure_smollm2())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-data-prep-"))
    data = write_chitchat_jsonl(work / "conversations.jsonl", args.rows, args.min_chars, 2 * args.min_chars)
    cfg = config_from_dict({
        "model": {"target": args.target},
        "data": {"train_files": [str(data)], "cache_dir": str(work / f"cache-{time.time_ns()}"),
                 "max_length": args.max_length},
        "draft": {"draft_vocab_size": args.draft_vocab_size},
    })
    tok = load_tokenizer(cfg)
    V = target_vocab_size(cfg, tok)
    vd = min(args.draft_vocab_size, V)
    cfg.draft.draft_vocab_size = vd

    renderer = ChatRenderer(tok)
    texts = [renderer.render(rec["conversations"]) for _, rec in iter_records(str(data))]
    enc, t_floor = timed_call(lambda: tok(texts, return_offsets_mapping=True))
    n_tokens = sum(len(ids) for ids in enc["input_ids"])
    del enc
    _, t_chunked = timed_call(lambda: tokenize_in_chunks(tok, texts, 256))
    texts.clear()  # free the rendered texts before the build

    cache, t_cold = timed_call(lambda: ensure_prompt_cache(cfg, tok))
    hit, t_hit = timed_call(lambda: ensure_prompt_cache(cfg, tok))
    assert cache.built and not hit.built
    vm, t_vocab = timed_call(lambda: ensure_vocab_map(cfg, cache, V))
    _, t_vocab_hit = timed_call(lambda: ensure_vocab_map(cfg, cache, V))

    rows = cache.meta["rows_out"]["train"]
    res = {
        "rows": args.rows, "rows_cached": rows, "tokens_per_row": round(n_tokens / args.rows),
        "floor_rows_s": round(args.rows / t_floor, 1), "floor_tokens_s": round(n_tokens / t_floor),
        "cold_rows_s": round(args.rows / t_cold, 1), "cold_tokens_s": round(cache.meta["tokens"]["total"] / t_cold),
        "chunked_floor_rows_s": round(args.rows / t_chunked, 1),
        "cold_over_floor": round(t_floor / t_cold, 3), "cold_over_chunked_floor": round(t_chunked / t_cold, 3),
        "cold_s": round(t_cold, 2),
        "hit_s": round(t_hit, 3), "vocab_map_s": round(t_vocab, 3), "vocab_map_hit_s": round(t_vocab_hit, 3),
        "vocab_coverage": round(vm.coverage, 4), "V": V, "Vd": vd,
        "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(f"| rows | tokens/row | tokenizer floor rows/s (tok/s) | same, 256-row chunks rows/s "
          f"| cold build rows/s (tok/s) | cold/floor (cold/chunked) | open on hit s | vocab map s (hit s) "
          f"| load avg |\n|---|---|---|---|---|---|---|---|---|\n"
          f"| {res['rows']} | {res['tokens_per_row']} | {res['floor_rows_s']} ({res['floor_tokens_s']:,}) "
          f"| {res['chunked_floor_rows_s']} | {res['cold_rows_s']} ({res['cold_tokens_s']:,}) "
          f"| {res['cold_over_floor']} ({res['cold_over_chunked_floor']}) | {res['hit_s']} "
          f"| {res['vocab_map_s']} ({res['vocab_map_hit_s']}) | {res['load_avg_1m']} |")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
