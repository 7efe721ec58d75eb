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

Two engines answer, with the same output: ``hf`` (transformers' ``generate``, any device; the
default) and ``sglang`` (an in-process ``sglang.Engine`` on GPUs, which schedules each batch of
prompts itself: give it large batches). SGLang's engine is started with the target, no tokenizer
(``skip_tokenizer_init``: prompts go in as ids, answers come back as ids and are decoded here with
the run's tokenizer), ``capture.tp_size`` and the engine settings of ``capture.sglang``; its
contract, as SGLang 0.5.14 keeps it: ``generate(input_ids=[...], sampling_params={...})`` returns
one dict per prompt, in order, with ``output_ids`` (the matched stop token included) and
``meta_info["finish_reason"]`` (``{"type": "stop", "matched": id}`` or ``{"type": "length"}``).
"""

import json
import time
from pathlib import Path

import torch

from specforge_core.data.formats import BadRow, Row, detect_format, iter_records, parse_record
from specforge_core.data.tokenize import ChatRenderer
from specforge_core.errors import DataError
from specforge_core.decoding.verifier import load_target, stop_ids_of, stop_token_ids

ENGINES = ("hf", "sglang")


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


def sglang_answers(outputs: list[dict], stop_ids: set[int]) -> list[tuple[list[int], bool]]:
    """``answer_batch``'s (answer ids up to and incl. the stop token, stopped) of SGLang's
    ``generate`` outputs (module doc)."""
    answers = []
    for output in outputs:
        ids = list(output["output_ids"])
        cut = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), None)
        answers.append((ids[:cut] if cut else ids, cut is not None))
    return answers


def sglang_engine_kwargs(cfg, seed: int) -> dict:
    """``sglang.Engine`` keyword arguments for answering with the run's target (module doc)."""
    s = cfg.capture.sglang
    kwargs = {"model_path": cfg.model.target, "skip_tokenizer_init": True, "tp_size": cfg.capture.tp_size,
              "dtype": cfg.model.dtype, "trust_remote_code": cfg.model.trust_remote_code, "random_seed": seed,
              "mem_fraction_static": s.mem_fraction_static, "attention_backend": s.attention_backend,
              "context_length": s.context_length, **s.extra}
    return {k: v for k, v in kwargs.items() if v is not None}


class _Answerers:
    """Each engine's ``(answer(prompts, **sampling) -> answers, close())`` and the stop ids."""

    @staticmethod
    def hf(cfg, tok, end_of_turn, seed, engine_factory):
        model, _ = load_target(cfg)
        torch.manual_seed(seed)

        def answer(prompts, **sampling):
            return answer_batch(model, tok, prompts, **sampling)

        return answer, (lambda: None), stop_token_ids(model, tok, end_of_turn)

    @staticmethod
    def sglang(cfg, tok, end_of_turn, seed, engine_factory):
        from transformers import GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(cfg.model.target)
        except OSError:  # no generation_config.json: the tokenizer's eos and the template's end
            generation = None
        stops = stop_ids_of(generation, tok, end_of_turn)
        if engine_factory is None:
            from specforge_core.capture.sglang_engine import start_generation_engine as engine_factory
        engine = engine_factory(**sglang_engine_kwargs(cfg, seed))

        def answer(prompts, *, max_new_tokens, stop_ids, temperature, top_p):
            params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                      "stop_token_ids": sorted(stop_ids)}
            return sglang_answers(engine.generate(input_ids=prompts, sampling_params=params), stop_ids)

        return answer, engine.shutdown, stops


def regenerate(cfg, out: Path, *, files: list[str] | None = None, batch_size: int = 16,
               max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, limit: int | None = None, engine: str = "hf", engine_factory=None) -> dict:
    """Answer every pending prompt of ``files`` (default ``data.train_files``) into ``out`` with
    ``engine`` (``hf`` or ``sglang``; ``engine_factory`` stands in for ``sglang.Engine``)."""
    from specforge_core.data.tokenize import load_tokenizer

    if engine not in ENGINES:
        raise DataError(f"unknown engine {engine!r}", where="--engine", fix=f"use one of {', '.join(ENGINES)}")
    files = files or cfg.data.train_files
    if not files:
        raise DataError("no source conversations to answer", where="data.train_files",
                        fix="set data.train_files or pass --input FILE")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = written_ids(out)
    tok = load_tokenizer(cfg)
    renderer = ChatRenderer(tok, template_kwargs=cfg.data.chat_template_kwargs)  # as the training data renders
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

    def summary(written: int, tokens: int, stopped: int, seconds: float) -> dict:
        return {"out": str(out), "engine": engine, "written": written, "already_written": len(done),
                "skipped_too_long": too_long, "skipped_bad_rows": bad, "answer_tokens": tokens,
                "ended_on_end_of_turn": stopped, "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None}

    if not rendered:  # nothing left to answer: no model or engine to start
        out.touch()
        return summary(0, 0, 0, 0.0)
    answer, close, stops = getattr(_Answerers, engine)(cfg, tok, renderer.end_of_turn, seed + len(done),
                                                       engine_factory)
    written = tokens = stopped = 0
    start = time.perf_counter()
    try:
        with open(out, "a", encoding="utf-8") as f:
            for b in range(0, len(rendered), batch_size):
                batch = rendered[b : b + batch_size]
                answers = answer([r[3] for r in batch], max_new_tokens=max_new_tokens, stop_ids=stops,
                                 temperature=temperature, top_p=top_p)
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
    finally:
        close()
    return summary(written, tokens, stopped, time.perf_counter() - start)
