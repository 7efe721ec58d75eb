"""The draft vocabulary map (d2t / t2d): which Vd of the target's V tokens the draft predicts.

    vm = ensure_vocab_map(cfg, cache, target_vocab_size)   # builds once, then loads
    vm = load_vocab_map(path, V, Vd)                          # any saved map, checked

Selection (specforge-facts §4.1): count token frequencies over loss-masked tokens of the prompt
cache's train split (already truncated to max_length), streamed from the memory-mapped Arrow
file a record batch at a time; take the Vd most frequent (ties: lower id first), padded with the
lowest unused ids when the corpus has fewer than Vd distinct tokens; order them by ascending
target id. Then ``d2t[i] = target_id(i) - i`` (int64, ``[Vd]``) and ``t2d[j] = j is selected``
(bool, ``[V]``); ``Vd == V`` gives the identity (d2t = 0, t2d all True) without a corpus walk.

Files: ``<data.cache_dir>/vocab/<key>.pt`` = ``torch.save({"d2t", "t2d"})`` and ``<key>.json``
(coverage of the top-Vd and counts). The key is sha256 over the prompt cache key, V and Vd, so a
hit needs only the cache's key: it never walks the corpus.
"""

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specforge_core.errors import DataError, ModelError

SCHEMA_VERSION = 1
_BATCH_ROWS = 1024


@dataclass
class VocabMap:
    """A checked vocab map. ``coverage``: share of supervised tokens inside the draft vocab."""

    key: str
    path: Path
    d2t: torch.Tensor
    t2d: torch.Tensor
    coverage: float | None
    built: bool = False


def vocab_map_key(prompt_cache_key: str, target_vocab_size: int, draft_vocab_size: int) -> str:
    ident = f"vocab-map-v{SCHEMA_VERSION}:{prompt_cache_key}:{target_vocab_size}:{draft_vocab_size}"
    return hashlib.sha256(ident.encode()).hexdigest()


def token_counts(dataset, vocab_size: int) -> np.ndarray:
    """Frequencies (int64 ``[V]``) of loss-masked tokens, streamed from the Arrow table in batches."""
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in dataset.data.table.to_batches(max_chunksize=_BATCH_ROWS):
        ids = pc.list_flatten(batch.column("input_ids")).to_numpy()
        mask = pc.list_flatten(batch.column("loss_mask")).to_numpy()
        picked = ids[mask.astype(bool)]
        if picked.size and (picked.min() < 0 or picked.max() >= vocab_size):
            bad = int(picked.max() if picked.max() >= vocab_size else picked.min())
            raise ModelError(
                f"token id {bad} in the prompt cache is outside the target vocabulary [0, {vocab_size})",
                where="model.target", fix="use the target's own tokenizer for the data",
            )
        counts += np.bincount(picked, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) from token counts; see the module docstring for the rule."""
    V = len(counts)
    order = np.lexsort((np.arange(V), -counts))  # count descending, then id ascending
    used = np.sort(order[:draft_vocab_size])
    t2d = np.zeros(V, dtype=bool)
    t2d[used] = True
    return torch.from_numpy(used - np.arange(draft_vocab_size)).long(), torch.from_numpy(t2d)


def _check_sizes(V: int, Vd: int) -> None:
    if not 0 < Vd <= V:
        raise ModelError(f"draft vocab size {Vd} must be in [1, target vocab size {V}]",
                         where="draft.draft_vocab_size", fix=f"set draft.draft_vocab_size to at most {V}")


def ensure_vocab_map(cfg, cache, target_vocab_size: int) -> VocabMap:
    """The vocab map of ``cache`` for V = ``target_vocab_size`` and Vd = ``draft.draft_vocab_size``.

    ``draft.vocab_map_path`` set: that file, checked. Otherwise built once under
    ``<data.cache_dir>/vocab`` (file lock; atomic writes) and loaded on every later call.
    """
    from filelock import FileLock

    V, Vd = target_vocab_size, cfg.draft.draft_vocab_size
    _check_sizes(V, Vd)
    if cfg.draft.vocab_map_path:
        return load_vocab_map(cfg.draft.vocab_map_path, V, Vd)
    key = vocab_map_key(cache.key, V, Vd)
    root = Path(cfg.data.cache_dir) / "vocab"
    path = root / f"{key}.pt"
    if path.exists():
        return load_vocab_map(path, V, Vd)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if not path.exists():
            _build(cache, key, path, V, Vd)
            built = True
        else:
            built = False
    vm = load_vocab_map(path, V, Vd)
    vm.built = built
    return vm


def _build(cache, key: str, path: Path, V: int, Vd: int) -> None:
    if Vd == V:
        counts, coverage = None, 1.0
        d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    else:
        counts = token_counts(cache.train, V)
        d2t, t2d = select_draft_vocab(counts, Vd)
        total = int(counts.sum())
        coverage = float(counts[t2d.numpy()].sum() / total) if total else 0.0
    sidecar = {
        "key": key, "schema": SCHEMA_VERSION, "prompt_cache_key": cache.key,
        "target_vocab_size": V, "draft_vocab_size": Vd, "coverage": coverage,
        "supervised_tokens": None if counts is None else int(counts.sum()),
        "distinct_tokens": None if counts is None else int((counts > 0).sum()),
    }
    _atomic(path.with_suffix(".json"), lambda f: f.write(json.dumps(sidecar, indent=1).encode()))
    _atomic(path, lambda f: torch.save({"d2t": d2t, "t2d": t2d}, f))  # written last: marks completion


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_vocab_map(path: str | Path, target_vocab_size: int, draft_vocab_size: int) -> VocabMap:
    """Load ``torch.save({"d2t", "t2d"})`` and check it fits V and Vd and is self-consistent
    (``nonzero(t2d) == d2t + arange(Vd)``). Raises :class:`ModelError` naming what differs."""
    path = Path(path)
    V, Vd = target_vocab_size, draft_vocab_size
    fix = "delete the file to rebuild it, or point draft.vocab_map_path at a map for this target and Vd"
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError("vocab map file not found", where=str(path), fix="check draft.vocab_map_path") from None
    except Exception as e:  # noqa: BLE001 - torn or foreign files fail in many ways
        raise DataError(f"cannot read the vocab map: {e}", where=str(path), fix=fix) from None
    if not isinstance(data, dict) or not {"d2t", "t2d"} <= set(data):
        raise DataError("not a vocab map (needs keys d2t and t2d)", where=str(path), fix=fix)
    d2t, t2d = data["d2t"], data["t2d"]
    problems = []
    if d2t.dtype != torch.long or tuple(d2t.shape) != (Vd,):
        problems.append(f"d2t is {d2t.dtype} {tuple(d2t.shape)}, expected int64 ({Vd},)")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (V,):
        problems.append(f"t2d is {t2d.dtype} {tuple(t2d.shape)}, expected bool ({V},)")
    if not problems and not torch.equal(torch.nonzero(t2d).flatten(), d2t + torch.arange(Vd)):
        problems.append("nonzero(t2d) != d2t + arange(Vd): the two halves disagree")
    if problems:
        raise ModelError("vocab map does not fit: " + "; ".join(problems), where=str(path), fix=fix)
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    key = meta.get("key") or hashlib.sha256(path.read_bytes()).hexdigest()
    return VocabMap(key=key, path=path, d2t=d2t, t2d=t2d, coverage=meta.get("coverage"))
