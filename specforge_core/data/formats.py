"""Conversation files in: JSONL or JSON arrays at any fsspec URL, in the row shapes users have.

Row shapes (``data.format``; ``auto`` decides per file from its first row):

- ``conversations``: ``{"conversations": [{"role", "content", ...}, ...], "tools": [...]?}``;
  messages may carry ``reasoning_content`` (or ``thinking``/``reasoning``), ``tool_calls``,
  ``tool_call_id``, ``name``; roles are system, user, assistant, tool.
- ``sharegpt``: ``{"conversations": [{"from": "human|gpt|system|tool", "value"}, ...]}``.
- ``messages``: ``{"messages": [...]}``, same messages as ``conversations``.
- ``text``: ``{"text": "<already chat-formatted>"}``.
- ``tokenized``: ``{"input_ids": [...], "loss_mask": [...]}`` (equal lengths, mask of 0/1).

Every per-row problem is a :class:`BadRow` naming ``file:line`` and the fix; the caller either
raises it or (``data.on_bad_row: skip``) counts it under its ``reason``. File-level problems
(missing, empty, unparseable JSON array) are plain :class:`DataError` and always stop the build.

:func:`source_digest` is the sha256 of a file's bytes, remembered per (URL, size, modification
stamp) so that a cache hit does not read the source again (see the function for the rule).
"""

import datetime as _dt
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from specforge_core.io import atomic_write_json
from specforge_core.errors import DataError

FORMATS = ("conversations", "sharegpt", "messages", "text", "tokenized")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
_SKIP_HINT = "or set data.on_bad_row=skip to drop and count such rows"
_MISSING_FIX = "check data.train_files / data.eval_files (fsspec URLs)"


class BadRow(DataError):
    """A problem confined to one row; ``reason`` is the key it is counted under when skipped."""

    def __init__(self, problem: str, *, where: str, fix: str, reason: str):
        self.reason = reason
        super().__init__(problem, where=where, fix=fix)


@dataclass(slots=True)
class Row:
    """One source row in a normalised shape: exactly one of messages / text / input_ids is set."""

    where: str
    messages: list[dict] | None = None
    tools: list | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


# ---------------------------------------------------------------------------------------------
# Files → JSON records


def _open(url: str, storage_options: dict):
    try:
        return fsspec.open(url, "rb", **storage_options).open()
    except FileNotFoundError:
        raise DataError("file not found", where=url, fix=_MISSING_FIX) from None
    except IsADirectoryError:
        raise DataError("is a directory, not a file", where=url, fix="name the JSONL/JSON files themselves") from None


def _not_utf8(err: UnicodeDecodeError, where: str) -> BadRow:
    return BadRow(
        f"not valid UTF-8 (byte 0x{err.object[err.start]:02x} at byte {err.start + 1})",
        where=where,
        fix=f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), {_SKIP_HINT}",
        reason="not_utf8",
    )


def iter_records(url: str, storage_options: dict | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` for every row of a JSONL or JSON-array file.

    ``record`` is the parsed JSON value, or a :class:`BadRow` for a line that is not UTF-8 or not
    JSON (JSONL only; in a JSON array such a problem is fatal for the whole file). Raises
    :class:`DataError` for a missing file or one without rows.
    """
    n = 0
    with _open(url, storage_options or {}) as f:
        head = f.read(4096)
        first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
        if first == b"[":
            yield from _iter_array(url, head + f.read())
            return
        lineno = 0
        for raw in _lines(head, f):
            lineno += 1
            if not raw.strip():
                continue
            n += 1
            where = f"{url}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield where, _not_utf8(e, where)
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, BadRow(
                    f"not valid JSON: {e.msg} (column {e.colno})",
                    where=where,
                    fix=f"fix or remove this line (one JSON object per line), {_SKIP_HINT}",
                    reason="bad_json",
                )
    if n == 0:
        raise DataError("contains no rows", where=url, fix="remove the empty file from the data files")


def count_records(url: str, storage_options: dict | None = None) -> int:
    """Rows of a JSONL or JSON-array file, counted without validating them: the non-blank lines of
    JSONL (not decoded or parsed), the elements of a JSON array (parsed one by one). An upper bound
    of the rows a prompt cache keeps (bad rows and rows without enough supervised tokens are
    dropped when it is built). Raises :class:`DataError` like :func:`iter_records`."""
    with _open(url, storage_options or {}) as f:
        head = f.read(4096)
        if head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
            return sum(1 for _ in _iter_array(url, head + f.read()))
        n = sum(1 for raw in _lines(head, f) if raw.strip())
    if n == 0:
        raise DataError("contains no rows", where=url, fix="remove the empty file from the data files")
    return n


def _lines(head: bytes, f) -> Iterator[bytes]:
    buf = head
    while True:
        chunk = f.read(1 << 20)
        if not chunk:
            break
        buf += chunk
        *full, buf = buf.split(b"\n")
        yield from full
    yield from buf.split(b"\n")


def _iter_array(url: str, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"not valid UTF-8 (byte 0x{data[e.start]:02x})", where=f"{url}:{line}",
            fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None
    dec = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0
    n = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(
                f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", where=f"{url}:{e.lineno}",
                fix="fix the JSON array (or write one JSON object per line as JSONL)",
            ) from None
        n += 1
        yield f"{url}:{line}", value
    if n == 0:
        raise DataError("contains no rows (empty JSON array)", where=url, fix="remove the empty file")


# ---------------------------------------------------------------------------------------------
# JSON records → normalised rows


def detect_format(record: Any, where: str) -> str:
    """The row shape of ``record`` (used on a file's first row when ``data.format`` is auto)."""
    if isinstance(record, dict):
        if "input_ids" in record:
            return "tokenized"
        if "text" in record and "conversations" not in record and "messages" not in record:
            return "text"
        if "messages" in record:
            return "messages"
        conv = record.get("conversations")
        if isinstance(conv, list):
            first = conv[0] if conv else {}
            return "sharegpt" if isinstance(first, dict) and "from" in first else "conversations"
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise DataError(
        f"cannot tell the row format from the first row (keys: {keys})", where=where,
        fix="use one of the keys conversations / messages / text / input_ids, or set data.format",
    )


def parse_record(record: Any, fmt: str, where: str, vocab_size: int) -> Row:
    """Normalise one JSON record of shape ``fmt`` into a :class:`Row`; raises :class:`BadRow`."""
    if not isinstance(record, dict):
        raise BadRow(f"row is a JSON {type(record).__name__}, expected an object", where=where,
                     fix=f"write one JSON object per row, {_SKIP_HINT}", reason="bad_row")
    if fmt == "tokenized":
        return _tokenized(record, where, vocab_size)
    if fmt == "text":
        text = record.get("text")
        if not isinstance(text, str) or not text:
            raise BadRow("'text' is missing, empty or not a string", where=where,
                         fix=f"give every row a non-empty 'text', {_SKIP_HINT}", reason="bad_row")
        return Row(where, text=text)
    key = "messages" if fmt == "messages" else "conversations"
    raw = record.get(key)
    if not isinstance(raw, list):
        raise BadRow(f"'{key}' is missing or not a list (format {fmt})", where=where,
                     fix=f"give every row a '{key}' list, or set data.format, {_SKIP_HINT}", reason="bad_row")
    if not raw:
        raise BadRow("empty conversation", where=where,
                     fix=f"remove the row or give it user/assistant messages, {_SKIP_HINT}", reason="bad_row")
    messages = [_message(m, i, where, sharegpt=fmt == "sharegpt") for i, m in enumerate(raw)]
    check_role_order(messages, where)
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRow("'tools' must be a list of JSON schemas", where=where, fix=f"fix 'tools', {_SKIP_HINT}",
                     reason="bad_row")
    return Row(where, messages=messages, tools=tools or None)


def _bad_message(i: int, where: str, problem: str, fix: str) -> BadRow:
    return BadRow(f"message {i}: {problem}", where=where, fix=f"{fix}, {_SKIP_HINT}", reason="bad_row")


def _message(m: Any, i: int, where: str, *, sharegpt: bool) -> dict:
    if not isinstance(m, dict):
        raise _bad_message(i, where, f"is a {type(m).__name__}, expected an object", "write messages as JSON objects")
    if sharegpt:
        role = SHAREGPT_ROLES.get(m.get("from"))
        if role is None:
            raise _bad_message(i, where, f"unknown 'from' {m.get('from')!r}", "use from: human, gpt, system or tool")
        content = m.get("value")
    else:
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise _bad_message(i, where, f"unknown role {role!r}", f"use one of {', '.join(ROLES)}")
    if content is None:
        content = ""
    elif type(content) is not str:
        raise _bad_message(i, where, "content is not a string",
                           "give text content (multimodal parts are not supported)")
    out: dict = {"role": role, "content": content}
    if len(m) == 2:  # the common case: nothing but role/content (or from/value)
        if role == "assistant" and not content:
            raise _bad_message(i, where, "assistant message is empty", "remove it or give it content")
        return out
    reasoning = m.get("reasoning_content", m.get("thinking", m.get("reasoning")))
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise _bad_message(i, where, "reasoning_content is not a string", "give reasoning as text")
        # Templates read reasoning under different names; fill the ones they use.
        out["reasoning_content"] = out["thinking"] = reasoning
    for k in ("tool_calls", "tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = m[k]
    if "tool_calls" in out and not isinstance(out["tool_calls"], list):
        raise _bad_message(i, where, "tool_calls is not a list", "give tool_calls as a list of calls")
    if role == "assistant" and not content and reasoning is None and "tool_calls" not in out:
        raise _bad_message(i, where, "assistant message is empty", "remove it or give it content")
    return out


def check_role_order(messages: list[dict], where: str) -> None:
    """System only first; then a user; assistant after user/tool; tool after assistant/tool."""
    prev = None
    for i, m in enumerate(messages):
        role = m["role"]
        ok = {
            "system": prev is None,
            "user": prev in (None, "system", "assistant", "tool"),
            "assistant": prev in ("user", "tool"),
            "tool": prev in ("assistant", "tool"),
        }[role]
        if not ok:
            after = f"after {prev}" if prev else "as the first message"
            raise BadRow(
                f"wrong role order: message {i} is {role} {after}", where=where,
                fix="order messages as [system], user, assistant, (tool, assistant)..., user, ...; "
                f"merge consecutive messages of one role, {_SKIP_HINT}",
                reason="role_order",
            )
        prev = role


def _tokenized(record: dict, where: str, vocab_size: int) -> Row:
    ids, mask = record.get("input_ids"), record.get("loss_mask")

    def bad(problem: str, fix: str) -> BadRow:
        return BadRow(problem, where=where, fix=f"{fix}, {_SKIP_HINT}", reason="bad_tokens")

    if not isinstance(ids, list) or not isinstance(mask, list):
        raise bad("needs lists 'input_ids' and 'loss_mask'", "give both lists")
    if len(ids) != len(mask):
        raise bad(f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}", "make the lengths equal")
    if not ids:
        raise bad("input_ids is empty", "remove the row")
    if not all(type(t) is int for t in ids):
        raise bad("input_ids holds non-integers", "give integer token ids")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad_id = lo if lo < 0 else hi
        raise bad(f"token id {bad_id} is outside the tokenizer vocabulary [0, {vocab_size})",
                  "tokenize with the target's own tokenizer")
    if any(v not in (0, 1) for v in mask):
        raise bad("loss_mask holds values other than 0 and 1", "use 1 for supervised tokens, 0 otherwise")
    return Row(where, input_ids=ids, loss_mask=mask)


# ---------------------------------------------------------------------------------------------
# Content digest


_TAG_KEYS = ("ETag", "etag", "md5Hash", "md5", "crc32c")
_TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")
_RACY_S = 2.0


def _stamp(info: dict) -> tuple[dict, float | None, bool]:
    """(identifying stamp, modification time or None, has a content tag) of an fsspec info dict."""
    stamp: dict = {"size": info.get("size")}
    mtime = None
    for k in _TIME_KEYS:
        v = info.get(k)
        if isinstance(v, _dt.datetime):
            v = v.timestamp()
        elif isinstance(v, str):
            try:
                v = _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        if isinstance(v, (int, float)):
            stamp[k], mtime = v, float(v)
            break
    if "mtime" in stamp and isinstance(info.get("created"), (int, float)):
        stamp["created"] = info["created"]  # a local file's st_ctime: a rewrite that restores mtime moves it
    tags = {k: str(info[k]) for k in _TAG_KEYS if info.get(k)}
    stamp.update(tags)
    if "ino" in info:
        stamp["ino"] = info["ino"]
    return stamp, mtime, bool(tags)


def source_digest(url: str, storage_options: dict | None = None, memo_dir: str | Path | None = None) -> str:
    """sha256 hex of the file's bytes (streamed), remembered in ``memo_dir`` when that is safe.

    A remembered digest is reused when the file's (URL, size, modification time, inode or
    content tag) are unchanged. Like git's racily-clean rule, a digest is only remembered for a
    file last modified more than 2 s before it was hashed, since a rewrite within the clock's
    granularity would keep the same stamp. Raises :class:`DataError` for a missing file.
    """
    opts = storage_options or {}
    fs, path = fsspec.core.url_to_fs(url, **opts)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise DataError("file not found", where=url, fix=_MISSING_FIX) from None
    if info.get("type") == "directory":
        raise DataError("is a directory, not a file", where=url, fix="name the JSONL/JSON files themselves")
    stamp, mtime, tagged = _stamp(info)
    memo = None
    if memo_dir is not None and (tagged or mtime is not None):
        ident = json.dumps({"url": fs.unstrip_protocol(path), "stamp": stamp}, sort_keys=True, default=str)
        memo = Path(memo_dir) / f"{hashlib.sha256(ident.encode()).hexdigest()}.json"
        if memo.exists():
            return json.loads(memo.read_text())["sha256"]
    hashed_at = time.time()
    h = hashlib.sha256()  # streamed from any fsspec URL (io.sha256_file reads local paths only)
    with _open(url, opts) as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None and (tagged or mtime < hashed_at - _RACY_S):
        atomic_write_json(memo, {"url": url, "sha256": digest}, indent=None)
    return digest
