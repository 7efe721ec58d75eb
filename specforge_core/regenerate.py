"""Answer a dataset's prompts with the target itself: drafts train best on the target's own outputs.

    python -m specforge_core.regenerate --config examples/smollm2-cpu.yaml --out data/regen.jsonl
    python -m specforge_core.regenerate --config C.yaml --out regen.jsonl --temperature 0.7 --top-p 0.9

For every source conversation (``data.train_files``, or ``--input`` files) the prompt is the
conversation up to its first assistant turn; the target answers it (greedy by default, sampled
with ``--temperature > 0``) in left-padded batches. Each answered row is appended to ``--out``
as ``{"id": ..., "conversations": [...prompt turns, {"role": "assistant", "content": answer}]}``,
the conversation format the data stage reads. Resumable: ids already in ``--out`` are skipped,
so an interrupted run continues where it stopped (a torn last line is dropped). Prints one JSON
line with the counts and throughput.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specforge_core.config import load_config
from specforge_core.errors import DataError, SpecForgeError
from specforge_core.eval.target import load_target, stop_token_ids

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system", "tool": "tool"}


def _read_rows(url: str, storage_options: dict):
    """(line number, row dict) of a JSONL or JSON-array file at any fsspec URL."""
    import fsspec

    with fsspec.open(url, "rt", encoding="utf-8", **storage_options) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        yield from enumerate(json.loads(text), start=1)
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"not valid JSON: {e.msg}", where=f"{url}:{n}", fix="fix or remove the line") from None


def prompt_turns(row: dict, where: str) -> list[dict] | None:
    """The conversation's turns before its first assistant turn (None if it has no user turn)."""
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list):
        raise DataError(
            "row has no `conversations` or `messages` list",
            where=where,
            fix='give each row {"conversations": [{"role": "user", "content": "..."}, ...]}',
        )
    prompt = []
    for turn in turns:
        role = _ROLES.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            raise DataError(f"turn {turn!r} has no known role or text content", where=where,
                            fix="use role/content (or ShareGPT from/value) turns")
        if role == "assistant":
            break
        prompt.append({"role": role, "content": content})
    return prompt if any(t["role"] == "user" for t in prompt) else None


def written_ids(out: Path) -> set[str]:
    """Ids already answered in ``out``; a torn last line (interrupted write) is cut off."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if keep != data:
        out.write_bytes(keep)
    return {str(json.loads(line)["id"]) for line in keep.decode("utf-8").splitlines() if line.strip()}


def pending_prompts(files: list[str], storage_options: dict, done: set[str], limit: int | None):
    """(id, prompt turns) for every source row not yet answered, in file order."""
    out = []
    for url in files:
        name = Path(url).name
        for n, row in _read_rows(url, storage_options):
            row_id = str(row.get("id", f"{name}:{n}"))
            turns = prompt_turns(row, f"{url}:{n}")
            if turns is not None and row_id not in done:
                out.append((row_id, turns))
            if limit is not None and len(out) >= limit:
                return out
    return out


@torch.inference_mode()
def answer_batch(model, tok, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: set[int],
                 temperature: float, top_p: float) -> list[tuple[list[int], bool]]:
    """Generate for left-padded ``prompts``; (answer ids up to and incl. the stop token, stopped)."""
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stop_ids)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         eos_token_id=sorted(stop_ids), pad_token_id=pad, **sampling)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), None)
        answers.append((row[:cut] if cut else row, cut is not None))
    return answers


def regenerate(cfg, out: Path, *, files: list[str] | None = None, batch_size: int = 16,
               max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, limit: int | None = None) -> dict:
    """Answer every pending prompt of ``files`` (default ``data.train_files``) into ``out``."""
    files = files or cfg.data.train_files
    if not files:
        raise DataError("no source conversations to answer", where="data.train_files",
                        fix="set data.train_files or pass --input FILE")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = written_ids(out)
    todo = pending_prompts(files, cfg.data.storage_options, done, limit)
    model, tok = load_target(cfg)
    stops = stop_token_ids(model, tok)
    rendered = []
    too_long = 0
    for row_id, turns in todo:
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= cfg.data.max_length:
            too_long += 1
            continue
        rendered.append((row_id, turns, ids))
    rendered.sort(key=lambda r: len(r[2]))  # similar lengths per batch: less padding
    torch.manual_seed(seed + len(done))
    written = tokens = stopped = 0
    start = time.perf_counter()
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(rendered), batch_size):
            batch = rendered[b : b + batch_size]
            answers = answer_batch(model, tok, [r[2] for r in batch], max_new_tokens=max_new_tokens,
                                   stop_ids=stops, temperature=temperature, top_p=top_p)
            for (row_id, turns, _), (ans, hit_stop) in zip(batch, answers):
                content = tok.decode(ans, skip_special_tokens=True)
                row = {"id": row_id, "conversations": turns + [{"role": "assistant", "content": content}]}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
                tokens += len(ans)
                stopped += hit_stop
            f.flush()
    seconds = time.perf_counter() - start
    return {"out": str(out), "written": written, "already_written": len(done), "skipped_too_long": too_long,
            "answer_tokens": tokens, "ended_on_end_of_turn": stopped, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.regenerate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="run config YAML (model.*, data.*)")
    ap.add_argument("--out", required=True, help="JSONL to append answered conversations to")
    ap.add_argument("--input", action="append", help="source file(s) instead of data.train_files")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="answer at most this many pending prompts")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.dtype=bfloat16")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        result = regenerate(cfg, Path(args.out), files=args.input, batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, limit=args.limit)
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
