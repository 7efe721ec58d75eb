"""The draft vocabulary map (d2t / t2d): which Vd of the target's V tokens the draft predicts.

    vm = ensure_vocab_map(cfg, cache, target_vocab_size)   # builds once, then loads
    vm = load_vocab_map(path, V, Vd)                          # any saved map, checked

Selection (SpecForge's rule, so our maps and its maps agree): count token frequencies over loss-masked tokens of the prompt
cache's train split (already truncated to max_length), streamed from the memory-mapped Arrow
file a record batch at a time; take the Vd most frequent (ties: lower id first), padded with the
lowest unused ids when the corpus has fewer than Vd distinct tokens; order them by ascending
target id. Then ``d2t[i] = target_id(i) - i`` (int64, ``[Vd]``) and ``t2d[j] = j is selected``
(bool, ``[V]``); ``Vd == V`` gives the identity (d2t = 0, t2d all True) without a corpus walk.

Files: ``<data.cache_dir>/vocab/<key>.pt`` = ``torch.save({"d2t", "t2d"})`` and ``<key>.json``
(coverage of the top-Vd, counts, and the size and sha256 of the ``.pt``). The key is sha256 over
the prompt cache key, V and Vd, so a hit needs only the cache's key: it never walks the corpus.
The sidecar is written first and the ``.pt`` last, each atomically (temp file, fsync, rename), so
the ``.pt`` existing means the map is complete; temp files of a killed build are removed by the
next build of that key. Loading checks the ``.pt`` against the sidecar's sha256 when there is one
(always, for maps built here) and refuses a changed or torn file.
"""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specforge_core.io import atomic_write_bytes
from specforge_core.errors import DataError, ModelError

SCHEMA_VERSION = 2  # 2: the sidecar carries the .pt's sha256
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


def check_vocab_sizes(V: int, Vd: int) -> None:
    """Raise :class:`ModelError` unless 0 < Vd ≤ V."""
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
    check_vocab_sizes(V, Vd)
    if cfg.draft.vocab_map_path:
        return load_vocab_map(cfg.draft.vocab_map_path, V, Vd)
    key = vocab_map_key(cache.key, V, Vd)
    root = Path(cfg.data.cache_dir) / "vocab"
    path = root / f"{key}.pt"
    if path.exists():
        return _load_built(path, V, Vd)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if not path.exists():
            for tmp in root.glob(f".{key}.*.tmp"):  # left by a killed build; we hold the key's lock
                tmp.unlink(missing_ok=True)
            _build(cache, key, path, V, Vd)
            built = True
        else:
            built = False
    vm = _load_built(path, V, Vd)
    vm.built = built
    return vm


def _load_built(path: Path, V: int, Vd: int) -> VocabMap:
    """A map built by :func:`ensure_vocab_map`: its sidecar, and so its checksum, must be there."""
    if not path.with_suffix(".json").exists():
        raise DataError("the vocab map's sidecar (.json with its checksum) is missing", where=str(path),
                        fix=f"delete {path} to rebuild it")
    return load_vocab_map(path, V, Vd)


def _build(cache, key: str, path: Path, V: int, Vd: int) -> None:
    if Vd == V:
        counts, coverage = None, 1.0
        d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    else:
        counts = token_counts(cache.train, V)
        d2t, t2d = select_draft_vocab(counts, Vd)
        total = int(counts.sum())
        coverage = float(counts[t2d.numpy()].sum() / total) if total else 0.0
    buf = io.BytesIO()
    torch.save({"d2t": d2t, "t2d": t2d}, buf)
    data = buf.getvalue()
    sidecar = {
        "key": key, "schema": SCHEMA_VERSION, "prompt_cache_key": cache.key,
        "target_vocab_size": V, "draft_vocab_size": Vd, "coverage": coverage,
        "supervised_tokens": None if counts is None else int(counts.sum()),
        "distinct_tokens": None if counts is None else int((counts > 0).sum()),
        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
    }
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(sidecar, indent=1).encode(), durable=True)
    atomic_write_bytes(path, data, durable=True)  # written last: marks completion


def load_vocab_map(path: str | Path, target_vocab_size: int, draft_vocab_size: int) -> VocabMap:
    """Load ``torch.save({"d2t", "t2d"})`` and check it fits V and Vd and is self-consistent
    (``nonzero(t2d) == d2t + arange(Vd)``). Raises :class:`ModelError` naming what differs."""
    path = Path(path)
    V, Vd = target_vocab_size, draft_vocab_size
    fix = "delete the file to rebuild it, or point draft.vocab_map_path at a map for this target and Vd"
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        raise DataError("vocab map file not found", where=str(path), fix="check draft.vocab_map_path") from None
    meta = _read_sidecar(path, fix)
    if "sha256" in meta and hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise DataError(f"the vocab map does not match the checksum in {path.with_suffix('.json').name} "
                        f"({len(raw)} bytes, {meta.get('bytes')} recorded): corrupt or changed",
                        where=str(path), fix=fix)
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
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
    key = meta.get("key") or hashlib.sha256(raw).hexdigest()
    return VocabMap(key=key, path=path, d2t=d2t, t2d=t2d, coverage=meta.get("coverage"))


def _read_sidecar(path: Path, fix: str) -> dict:
    """The ``.json`` beside a vocab map ({} when there is none, e.g. a map from elsewhere)."""
    sidecar = path.with_suffix(".json")
    try:
        meta = json.loads(sidecar.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as e:
        raise DataError(f"the vocab map's sidecar is unreadable ({e})", where=str(sidecar), fix=fix) from None
    if not isinstance(meta, dict):
        raise DataError("the vocab map's sidecar is not a JSON object", where=str(sidecar), fix=fix)
    return meta
