"""Answer a dataset's prompts with the target itself: drafts train best on the target's own outputs.

    result = regenerate(cfg, Path("data/regen.jsonl"), batch_size=16, max_new_tokens=256)

For every source conversation (``data.train_files``, or ``files``) the prompt is the conversation
up to its first assistant turn, rendered with the chat template and ``data.chat_template_kwargs``
exactly as the prompt cache renders training rows; the target answers it (greedy by default, sampled with
``temperature > 0``) in left-padded batches. Each answered row is appended to ``out`` as
``{"id": ..., "conversations": [...prompt turns, {"role": "assistant", "content": answer}]}``, the
conversation format the data stage reads. Resumable: ids already in ``out`` are skipped, so an
interrupted run continues where it stopped (a torn last line is dropped). Returns the counts and
throughput. ``python -m specforge_core.regenerate`` is the command.
"""

import json
import time
from pathlib import Path

import torch

from specforge_core.data.formats import BadRow, Row, detect_format, iter_records, parse_record
from specforge_core.data.tokenize import ChatRenderer
from specforge_core.errors import DataError
from specforge_core.decoding.verifier import load_target, stop_token_ids


def prompt_messages(row: Row) -> list[dict] | None:
    """The row's messages before its first assistant turn (None if they hold no user turn)."""
    if row.messages is None:
        raise DataError(
            "row is pre-rendered text or pre-tokenized: there is no conversation to answer",
            where=row.where,
            fix="regenerate from conversation rows (conversations / messages / ShareGPT)",
        )
    k = next((i for i, m in enumerate(row.messages) if m["role"] == "assistant"), len(row.messages))
    prompt = row.messages[:k]
    return prompt if any(m["role"] == "user" for m in prompt) else None


def written_ids(out: Path) -> set[str]:
    """Ids already answered in ``out``; a torn last line (interrupted write) is cut off."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if keep != data:
        out.write_bytes(keep)
    # split on "\n" only: str.splitlines would also cut at U+2028/U+0085 inside an answer's text
    return {str(json.loads(line)["id"]) for line in keep.decode("utf-8").split("\n") if line.strip()}


def pending_prompts(cfg, files: list[str], done: set[str], vocab_size: int, limit: int | None):
    """(id, prompt messages, tools) of every source row not yet answered, in file order, and the
    number of bad rows skipped (``data.on_bad_row: skip``; ``error`` raises the first)."""
    out, bad = [], 0
    for url in files:
        fmt = None if cfg.data.format == "auto" else cfg.data.format
        for where, rec in iter_records(url, cfg.data.storage_options):
            try:
                if isinstance(rec, BadRow):
                    raise rec
                fmt = fmt or detect_format(rec, where)
                row = parse_record(rec, fmt, where, vocab_size)
            except BadRow:
                if cfg.data.on_bad_row == "error":
                    raise
                bad += 1
                continue
            row_id = str(rec.get("id", where.replace(url, Path(url).name, 1)))
            prompt = prompt_messages(row)
            if prompt is not None and row_id not in done:
                out.append((row_id, prompt, row.tools))
            if limit is not None and len(out) >= limit:
                return out, bad
    return out, bad


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
    model, tok = load_target(cfg)
    renderer = ChatRenderer(tok, template_kwargs=cfg.data.chat_template_kwargs)  # as the training data renders
    stops = stop_token_ids(model, tok, renderer.end_of_turn)
    todo, bad = pending_prompts(cfg, files, done, len(tok), limit)
    rendered = []
    too_long = 0
    for row_id, turns, tools in todo:
        ids = tok(renderer.render(turns, tools, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if len(ids) >= cfg.data.max_length:
            too_long += 1
            continue
        rendered.append((row_id, turns, tools, ids))
    rendered.sort(key=lambda r: len(r[3]))  # similar lengths per batch: less padding
    torch.manual_seed(seed + len(done))
    written = tokens = stopped = 0
    start = time.perf_counter()
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(rendered), batch_size):
            batch = rendered[b : b + batch_size]
            answers = answer_batch(model, tok, [r[3] for r in batch], max_new_tokens=max_new_tokens,
                                   stop_ids=stops, temperature=temperature, top_p=top_p)
            for (row_id, turns, tools, _), (ans, hit_stop) in zip(batch, answers):
                content = tok.decode(ans, skip_special_tokens=True)
                row = {"id": row_id, "conversations": turns + [{"role": "assistant", "content": content}]}
                if tools:
                    row["tools"] = tools
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
                tokens += len(ans)
                stopped += hit_stop
            f.flush()
    seconds = time.perf_counter() - start
    return {"out": str(out), "written": written, "already_written": len(done), "skipped_too_long": too_long,
            "skipped_bad_rows": bad,
            "answer_tokens": tokens, "ended_on_end_of_turn": stopped, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None}
