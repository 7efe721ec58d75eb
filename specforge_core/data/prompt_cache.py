"""The prompt cache: tokenized rows with loss masks, as memory-mapped Arrow, keyed on content.

    cache = ensure_prompt_cache(cfg, tokenizer)   # builds once, then opens: cache.train, cache.eval

Layout under ``<data.cache_dir>/prompts/``::

    <key>/train.arrow   input_ids (list<int32>), loss_mask (list<int8>, 1 = supervised), length (int32)
    <key>/eval.arrow    the same columns + prompt_ids (list<int32>: the conversation up to its first
                        assistant turn, rendered with the generation prompt)
    <key>/meta.json     rows in/out, drops by reason, token counts, length histogram, build id,
                        and ``files``: the size and sha256 of each Arrow file
    <key>.lock          the file lock that makes one process build while the others wait

The key (:func:`prompt_cache_key`) is a sha256 over every source file's bytes, the tokenizer
(vocabulary, merges, added tokens), the chat template and its ``data.chat_template_kwargs``, and
every option that changes the rows.
It is also the Prefect cache key of the prepare task. Builds write into a temporary directory
beside the final one, fsync it and rename it into place, so a cache directory is always complete;
on any error the temporary directory is removed, and one left by a killed build is removed by the
next build of that key (which holds the lock, so no live build owns it). Every open checks each
Arrow file against the sha256 in meta.json and refuses a changed or torn file (about 0.7 s per GB
of cache). Processes started without Prefect (torchrun ranks) coordinate through the lock file
only: no collective is entered while a cache is being built.
"""

import contextlib
import hashlib
import json
import os
import random
import shutil
import socket
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specforge_core.data.formats import BadRow, Row, detect_format, iter_records, parse_record, source_digest
from specforge_core.data.tokenize import RowTokenizer, Tokenized, effective_template
from specforge_core.io import fsync_dir, fsync_file, sha256_file
from specforge_core.errors import ConfigError, DataError, SpecForgeError

if TYPE_CHECKING:
    import datasets

SCHEMA_VERSION = 2  # 2: meta.json carries the checksum table
DATA_FILES = ("train.arrow", "eval.arrow")
_CHUNK_ROWS = 256


@dataclass
class PromptCache:
    """An opened prompt cache. ``built`` is True only in the process whose call built it.

    ``train`` / ``eval`` are the splits as memory-mapped ``datasets.Dataset`` (opened on first use);
    ``rows(split)`` reads the same Arrow file with pyarrow alone, which is what a training rank needs
    (``len`` and ``rows[i]``) without importing ``datasets`` and pandas in every rank (seconds of
    CPU per rank start).
    """

    key: str
    path: Path
    meta: dict
    built: bool = False

    @cached_property
    def train(self) -> "datasets.Dataset":
        return _open_split(self.path, "train")

    @cached_property
    def eval(self) -> "datasets.Dataset":
        return _open_split(self.path, "eval")

    def rows(self, split: str = "train") -> "ArrowRows":
        return ArrowRows(self.path / f"{split}.arrow")


class ArrowRows:
    """A prompt-cache split read with pyarrow: ``len(rows)``, ``rows[i]`` → ``{column: list}``,
    ``rows.column("length")``."""

    def __init__(self, path: Path):
        import pyarrow as pa

        # the cache's files are Arrow IPC streams (datasets' format); memory-mapped, nothing copied
        self._table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()

    def __len__(self) -> int:
        return self._table.num_rows

    @property
    def num_rows(self) -> int:
        return self._table.num_rows

    def column(self, name: str) -> np.ndarray:
        """One column of scalars as a NumPy array (``length``: every row's token count)."""
        return self._table.column(name).to_numpy()

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        return {name: self._table.column(name)[index].as_py() for name in self._table.column_names}


def _open_split(path: Path, split: str) -> "datasets.Dataset":
    from datasets import Dataset

    return Dataset.from_file(str(path / f"{split}.arrow"))


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, normaliser, added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _sha(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text else None


def prompt_cache_key(cfg, tokenizer) -> str:
    """The content key of the prompt cache ``cfg`` and ``tokenizer`` produce (sha256 hex).

    Reads each source file once to hash it (remembered under ``<cache_dir>/sources``, so a
    repeat call reads nothing); parses nothing. Raises :class:`DataError` for a missing file.
    """
    d = cfg.data
    if not d.train_files:
        raise ConfigError("no training data", where="data.train_files", fix="list your JSONL/JSON files there")
    memo = Path(d.cache_dir) / "sources"
    ident = {
        "schema": SCHEMA_VERSION,
        "train": [source_digest(u, d.storage_options, memo) for u in d.train_files],
        "eval": [source_digest(u, d.storage_options, memo) for u in d.eval_files],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": _sha(effective_template(tokenizer, cfg.model.chat_template)),
        "max_length": d.max_length,
        "format": d.format,
        "train_only_last_turn": d.train_only_last_turn,
        "min_loss_tokens": d.min_loss_tokens,
        "on_bad_row": d.on_bad_row,
        "max_rows": d.max_rows,
        "eval_holdout": 0 if d.eval_files else d.eval_holdout,
    }
    if d.chat_template_kwargs:  # only when set: caches built before the option keep their keys
        ident["chat_template_kwargs"] = d.chat_template_kwargs
    if d.supervise != "assistant":  # likewise
        ident["supervise"] = d.supervise
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _nothing_left_on_refusal(cache_dir: Path) -> Iterator[None]:
    """On a refused input (a SpecForgeError), remove what the block added to ``cache_dir``: the
    digests it remembered, the lock files it created and the directories it made (when empty).

    A lock file is shared by every builder of its key, but each of them is refused the same input,
    so none is left holding the one removed here.
    """
    dirs = [cache_dir / "prompts", cache_dir / "sources", cache_dir]
    made = [d for d in dirs if not d.exists()]
    listed = {d: set(os.listdir(d)) for d in dirs[:2] if d.exists()}
    try:
        yield
    except SpecForgeError:
        for d in dirs[:2]:
            added = set(os.listdir(d)) - listed.get(d, set()) if d.is_dir() else set()
            for name in added:
                if d.name == "sources" or name.endswith(".lock"):
                    (d / name).unlink(missing_ok=True)
        for d in made:
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                d.rmdir()
        raise


def ensure_prompt_cache(cfg, tokenizer) -> PromptCache:
    """Open the prompt cache for ``cfg`` + ``tokenizer``, building it first if it is missing.

    Safe to call from many processes at once: exactly one builds, the others block on the lock
    file and then open the finished cache. A hit reads neither the source rows nor the tokenizer's
    template output. Raises :class:`DataError` (file:line and fix) on bad input; then nothing it
    wrote is left behind (no cache directory, lock file or remembered digest).
    """
    with _nothing_left_on_refusal(Path(cfg.data.cache_dir)):
        return _ensure_prompt_cache(cfg, tokenizer)


def _ensure_prompt_cache(cfg, tokenizer) -> PromptCache:
    from filelock import FileLock

    key = prompt_cache_key(cfg, tokenizer)
    root = Path(cfg.data.cache_dir) / "prompts"
    final = root / key
    if (final / "meta.json").exists():
        return open_prompt_cache(final)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if (final / "meta.json").exists():
            return open_prompt_cache(final)
        _remove_torn(root, key)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{key[:16]}-"))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by all ranks/users
            meta = _Build(cfg, tokenizer, key, tmp).run()
            meta["files"] = {name: _file_sum(tmp / name) for name in DATA_FILES}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            for name in (*DATA_FILES, "meta.json"):
                fsync_file(tmp / name)
            os.rename(tmp, final)
            fsync_dir(root)  # the rename itself survives a power cut
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return open_prompt_cache(final, built=True)


def open_prompt_cache(path: str | Path, *, built: bool = False) -> PromptCache:
    """Open a finished cache directory (memory-mapped) after checking every file's size and sha256
    against meta.json. Raises :class:`DataError` naming the file, with the fix (delete the
    directory to rebuild it), for a missing, unreadable, torn or changed file."""
    path = Path(path)
    meta = _read_meta(path)
    for name in DATA_FILES:
        _verify(path, name, meta["files"].get(name))
    return PromptCache(key=meta["key"], path=path, meta=meta, built=built)


# ---------------------------------------------------------------------------------------------
# Integrity


def _rebuild_fix(path: Path) -> str:
    return f"delete {path} and run again (python -m specforge_core.prepare --config ...) to rebuild it"


def _file_sum(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _read_meta(path: Path) -> dict:
    where = str(path / "meta.json")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError("not a prompt cache: meta.json is missing", where=where, fix=_rebuild_fix(path)) from None
    except (ValueError, OSError) as e:
        raise DataError(f"meta.json is unreadable ({e})", where=where, fix=_rebuild_fix(path)) from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA_VERSION or not isinstance(meta.get("files"), dict):
        got = meta.get("schema") if isinstance(meta, dict) else None
        raise DataError(f"meta.json is not a schema-{SCHEMA_VERSION} prompt cache record (schema {got!r})",
                        where=where, fix=_rebuild_fix(path))
    return meta


def _verify(path: Path, name: str, want: dict | None) -> None:
    """Refuse ``path/name`` unless its size and sha256 are the ones recorded at build time."""
    where = str(path / name)
    if not isinstance(want, dict):
        raise DataError(f"meta.json records no checksum for {name}", where=where, fix=_rebuild_fix(path))
    try:
        got = _file_sum(path / name)
    except FileNotFoundError:
        raise DataError(f"{name} is missing from the prompt cache", where=where, fix=_rebuild_fix(path)) from None
    if got["bytes"] != want.get("bytes"):
        problem = f"{name} has {got['bytes']} bytes, but {want.get('bytes')} were written (torn or changed)"
    elif got["sha256"] != want.get("sha256"):
        problem = (f"{name} does not match its checksum (sha256 {got['sha256'][:12]}…, recorded "
                   f"{str(want.get('sha256'))[:12]}…): the file is corrupt or was changed")
    else:
        return
    raise DataError(problem, where=where, fix=_rebuild_fix(path))


def _remove_torn(root: Path, key: str) -> None:
    """Remove what a killed build of ``key`` left behind. Call only while holding the key's lock:
    then no live process owns a temporary directory of this key, and a final directory without
    meta.json (which a build never produces) is damage, not a cache."""
    for tmp in root.glob(f".tmp-{key[:16]}-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    final = root / key
    if final.exists() and not (final / "meta.json").exists():
        shutil.rmtree(final, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Building


def _features(with_prompt: bool):
    from datasets import Features, List, Value

    cols = {"input_ids": List(Value("int32")), "loss_mask": List(Value("int8")), "length": Value("int32")}
    if with_prompt:
        cols["prompt_ids"] = List(Value("int32"))
    return Features(cols)


def _list_array(arrays: list[np.ndarray], dtype):
    import pyarrow as pa

    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)  # a chunk holds far fewer than 2**31 tokens
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


class _SplitWriter:
    """Appends tokenized rows to one Arrow file in the datasets format, a chunk at a time."""

    def __init__(self, path: Path, with_prompt: bool):
        from datasets.arrow_writer import ArrowWriter

        self.with_prompt = with_prompt
        self.writer = ArrowWriter(features=_features(with_prompt), path=str(path))
        self.pending: list[tuple[Tokenized, np.ndarray | None]] = []
        self.rows = 0
        self.lengths: list[int] = []

    def add(self, tok: Tokenized, prompt: np.ndarray | None = None) -> None:
        self.pending.append((tok, prompt))
        if len(self.pending) >= _CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if not self.pending:
            return
        toks = [t for t, _ in self.pending]
        cols = {
            "input_ids": _list_array([t.input_ids for t in toks], np.int32),
            "loss_mask": _list_array([t.loss_mask for t in toks], np.int8),
            "length": pa.array(np.array([len(t.input_ids) for t in toks], dtype=np.int32)),
        }
        if self.with_prompt:
            cols["prompt_ids"] = _list_array([p for _, p in self.pending], np.int32)
        self.writer.write_table(pa.table(cols))
        self.lengths.extend(len(t.input_ids) for t in toks)
        self.rows += len(toks)
        self.pending.clear()

    def close(self) -> None:
        self.flush()
        self.writer.finalize()
        self.writer.close()


@dataclass
class _Stats:
    rows_in: int = 0
    truncated: int = 0
    tokens: int = 0
    supervised: int = 0
    dropped: Counter = field(default_factory=Counter)
    sources: list = field(default_factory=list)


class _Build:
    """One build: read → normalise → render/tokenize/mask in chunks → Arrow, plus the eval split."""

    def __init__(self, cfg, tokenizer, key: str, out: Path):
        self.cfg, self.d, self.key, self.out = cfg, cfg.data, key, out
        self.vocab_size = len(tokenizer)
        self.tok = RowTokenizer(tokenizer, max_length=self.d.max_length,
                                train_only_last_turn=self.d.train_only_last_turn,
                                chat_template=cfg.model.chat_template,
                                chat_template_kwargs=self.d.chat_template_kwargs)
        self.stats = _Stats()

    def run(self) -> dict:
        t0 = time.time()
        train = _SplitWriter(self.out / "train.arrow", with_prompt=False)
        evals = _SplitWriter(self.out / "eval.arrow", with_prompt=True)
        holdout = 0 if self.d.eval_files else self.d.eval_holdout
        reservoir: list[tuple[int, Row, Tokenized]] = []
        rng = random.Random(0)  # the held-out rows are a fixed function of the data
        kept = 0
        for row, tok in self._tokenized(self.d.train_files, self.d.max_rows):
            if kept < holdout:
                reservoir.append((kept, row, tok))
            elif holdout and (j := rng.randrange(kept + 1)) < holdout:
                self._train(train, reservoir[j][2])
                reservoir[j] = (kept, row, tok)
            else:
                self._train(train, tok)
            kept += 1
        if holdout and train.rows + len(train.pending) == 0:
            raise DataError(
                f"data.eval_holdout={holdout} leaves no training rows ({kept} usable rows)",
                where="data.eval_holdout", fix="lower data.eval_holdout or add training data",
            )
        for _, row, tok in sorted(reservoir, key=lambda r: r[0]):
            evals.add(tok, self.tok.prompt_ids(row, tok))
        for row, tok in self._tokenized(self.d.eval_files, None):
            evals.add(tok, self.tok.prompt_ids(row, tok))
        train.close()
        evals.close()
        if train.rows == 0:
            raise DataError(
                f"no usable training rows (dropped: {dict(self.stats.dropped) or 'none'})",
                where=", ".join(self.d.train_files),
                fix="check that rows have assistant turns with at least data.min_loss_tokens tokens",
            )
        return self._meta(train, evals, time.time() - t0)

    def _train(self, train: "_SplitWriter", tok: Tokenized) -> None:
        """A training row as the loss sees it: ``data.supervise=all`` marks every token (the eval
        split keeps the assistant mask, which its prompts are cut by)."""
        if self.d.supervise == "all":
            self.stats.supervised += len(tok.loss_mask) - int(tok.loss_mask.sum())
            tok = Tokenized(tok.input_ids, np.ones_like(tok.loss_mask), tok.truncated)
        train.add(tok)

    def _tokenized(self, files: list[str], max_rows: int | None):
        """Yield (row, tokenized) for every kept row of ``files``; count and handle the rest."""
        for rows, results in self.tok.pipelined(self._chunks(files, max_rows)):
            for row, result in zip(rows, results):
                if isinstance(result, BadRow):
                    self._bad(result)
                    continue
                n_sup = int(result.loss_mask.sum())
                if n_sup < self.d.min_loss_tokens:
                    self.stats.dropped["too_few_loss_tokens"] += 1
                    continue
                self.stats.truncated += result.truncated
                self.stats.tokens += len(result.input_ids)
                self.stats.supervised += n_sup
                yield row, result

    def _chunks(self, files: list[str], max_rows: int | None):
        """Normalised rows of ``files`` in chunks; bad records are counted (or raised) here."""
        budget = max_rows
        for url in files:
            chunk: list[Row] = []
            fmt = None if self.d.format == "auto" else self.d.format
            rows = 0
            for where, rec in iter_records(url, self.d.storage_options):
                if budget is not None and budget <= 0:
                    break
                if budget is not None:
                    budget -= 1
                rows += 1
                try:
                    if isinstance(rec, BadRow):
                        raise rec
                    fmt = fmt or detect_format(rec, where)
                    chunk.append(parse_record(rec, fmt, where, self.vocab_size))
                except BadRow as e:
                    self._bad(e)
                if len(chunk) >= _CHUNK_ROWS:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
            self.stats.rows_in += rows
            self.stats.sources.append({"url": url, "format": fmt, "rows": rows})

    def _bad(self, err: BadRow) -> None:
        if self.d.on_bad_row == "error":
            raise err
        self.stats.dropped[err.reason] += 1

    def _meta(self, train: _SplitWriter, evals: _SplitWriter, seconds: float) -> dict:
        s, L = self.stats, self.d.max_length
        edges = sorted({0, *(2**k for k in range(4, 32) if 2**k < L), L + 1})
        counts, _ = np.histogram(np.asarray(train.lengths + evals.lengths), bins=edges)
        return {
            "key": self.key,
            "schema": SCHEMA_VERSION,
            "build": {"id": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(),
                      "seconds": round(seconds, 3)},
            "sources": s.sources,
            "options": {k: getattr(self.d, k) for k in ("format", "max_length", "train_only_last_turn",
                                                         "min_loss_tokens", "on_bad_row", "max_rows",
                                                         "eval_holdout", "chat_template_kwargs",
                                                         "supervise")},
            "chat_template": self.tok.markers,
            "rows_in": s.rows_in,
            "rows_out": {"train": train.rows, "eval": evals.rows},
            "dropped": dict(s.dropped),
            "truncated": s.truncated,
            "tokens": {"total": s.tokens, "supervised": s.supervised},
            "length_histogram": {"edges": edges, "counts": counts.tolist()},
        }
