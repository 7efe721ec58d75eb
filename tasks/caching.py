"""Prefect caching for the file-producing stages: keyed by content, trusted only while the file is there.

    @task(**stage_cache("prompt-cache"))
    def prepare_prompt_cache(cfg: RunConfig, key: str) -> StageOutput: ...

    out = run_cached(prepare_prompt_cache, cfg, key=prompt_cache_key(cfg, tokenizer))

Why not Prefect's default policy: it includes the flow-run id (no reuse across runs), and an
``INPUTS`` key on a path string neither notices a changed file behind the same path nor a deleted
output (a cached result keeps naming a file that is gone). Here the flow computes each stage's content key with the data
stage's pure key functions (data bytes, tokenizer + chat template, max_length, every option) and
passes it as the task's ``key`` argument, so the Prefect cache key is the data stage's key (plus a
hash of the directory the output goes to): one identity, visible as a task parameter in the UI.

A cached result only names where the output lives; ``run_cached`` checks that it is still there and
re-runs the task with ``refresh_cache=True`` when it is not (a cleaned cache directory, another
machine), which also overwrites the stale cache record.

Cached results are JSON, never pickles (``stage_cache``). Prefect decodes a stored record with the
serializer the record itself names, so asking for JSON only changes what is written; what is read
goes through ``StageRecordStorage``, which hands Prefect a record only if it is a JSON-serialized
``StageOutput`` of plain JSON values. Anything else (a pickle record from an older version or
written by someone else, an object reference) reads as a cache miss: the stage runs again and
overwrites it.
"""

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import Task
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.context import TaskRunContext
from prefect.filesystems import LocalFileSystem
from prefect.logging import get_run_logger
from prefect.serializers import JSONSerializer
from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH


@dataclass(frozen=True)
class StageOutput:
    """What a cached stage returns: its content key, where its output lives, a few facts for the UI.

    Small on purpose: it is the persisted Prefect result (never a dataset or tensors).
    ``marker`` is the file whose presence proves the output complete (default: ``path`` itself).
    """

    key: str
    path: str
    marker: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def present(self) -> bool:
        return Path(self.marker or self.path).exists()


def content_key(
    stage: str, location: Callable[[dict[str, Any]], str] | None = None
) -> Callable[[TaskRunContext, dict[str, Any]], str]:
    """A ``cache_key_fn`` returning ``<stage>-<key argument>[-<location hash>]``.

    The stage name keeps stages whose keys hash the same bytes apart in the shared result storage.
    ``location(parameters)`` names the directory the output is written to: the same content built
    into another cache directory is another cache entry, so a hit never hands a run an output that
    lives outside the directory it configured (its ranks would not find it there). Prefect logs an
    exception raised here and runs the task uncached.
    """

    def key_fn(context: TaskRunContext, parameters: dict[str, Any]) -> str:
        key = parameters.get("key")
        if not key or not isinstance(key, str):
            raise ValueError(f"task {context.task.name} needs a non-empty `key` argument (its content key)")
        if location is None:
            return f"{stage}-{key}"
        where = str(Path(location(parameters)).resolve())
        return f"{stage}-{key}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"

    key_fn.__name__ = f"content_key_{stage.replace('-', '_')}"
    return key_fn


STAGE_OUTPUT_CLASS = f"{StageOutput.__module__}.{StageOutput.__qualname__}"
_OBJECT_HOOKS = ("__class__", "__exc_type__")  # keys Prefect's JSON decoder turns into imports


def _plain_json(value: Any) -> bool:
    if isinstance(value, dict):
        return not any(k in _OBJECT_HOOKS for k in value) and all(_plain_json(v) for v in value.values())
    if isinstance(value, list):
        return all(_plain_json(v) for v in value)
    return True


def check_stage_result(content: bytes, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``content`` is a JSON-serialized ``StageOutput``
    of plain JSON values (no object reference Prefect's JSON decoder would import)."""
    try:
        result = json.loads(content)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e}): not read") from None
    if not (isinstance(result, dict) and result.get("__class__") == STAGE_OUTPUT_CLASS
            and isinstance(result.get("data"), dict) and set(result) == {"__class__", "data"}
            and set(result["data"]) <= {"key", "path", "marker", "facts"} and _plain_json(result["data"])):
        raise ValueError(f"{where}: not a plain StageOutput record: not read")


def _default_storage() -> LocalFileSystem:
    return LocalFileSystem(basepath=str(PREFECT_RESULTS_LOCAL_STORAGE_PATH.value()))


class StageRecordStorage(LocalFileSystem):
    """Where the cached stages' record metadata lives (the cache policy's ``key_storage``; default
    ``stage-records/`` in Prefect's local result storage, ``PREFECT_RESULTS_LOCAL_STORAGE_PATH``,
    which holds the results). Prefect reads a record's metadata here, then its result from the
    path the metadata names, decoded by the serializer the metadata names. So metadata is handed
    over only if its serializer is exactly Prefect's default JSON one (no other decoder or
    library) and the result it names passes ``check_stage_result``; otherwise ``ValueError``,
    which Prefect's cache lookup takes as a miss."""

    _block_type_name = "SpecForge Stage Records"

    def _resolve_path(self, path: str) -> Path:
        if self.basepath:
            return super()._resolve_path(path)
        records = PREFECT_RESULTS_LOCAL_STORAGE_PATH.value() / "stage-records"
        return LocalFileSystem(basepath=str(records))._resolve_path(path)

    def _checked(self, content: bytes, path: str) -> bytes:
        where = str(self._resolve_path(path))
        try:
            metadata = json.loads(content)
            serializer, result_key = metadata["serializer"], metadata["storage_key"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a result record's metadata ({e}): not read") from None
        if serializer != json.loads(JSONSerializer().model_dump_json()):
            raise ValueError(f"{where}: result serializer {serializer!r} is not Prefect's plain JSON: not read")
        try:  # the result the metadata names, which must lie in the result storage
            result = _default_storage()._resolve_path(result_key).read_bytes()
        except OSError as e:
            raise ValueError(f"{where}: its result {result_key} cannot be read ({e})") from None
        check_stage_result(result, result_key)
        return content

    def read_path(self, path: str, _sync: bool = True) -> bytes:
        # Prefect calls it as read_path(key, _sync=True) (its sync/async dispatch convention).
        return self._checked(self._resolve_path(path).read_bytes(), path)

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)


def stage_cache(stage: str, location: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
    """The ``@task`` options of a cached stage: keyed by ``content_key(stage, location)``, its
    result persisted as JSON, its records read back only through ``StageRecordStorage``."""
    policy = CacheKeyFnPolicy(cache_key_fn=content_key(stage, location)).configure(key_storage=StageRecordStorage())
    return {"cache_policy": policy, "persist_result": True, "result_serializer": "json"}


def run_cached(stage: Task, *args: Any, **kwargs: Any) -> StageOutput:
    """Call the cached ``stage``; if the output its (possibly cached) result names is gone, call it
    again with ``refresh_cache=True`` so it rebuilds and the cache record is replaced."""
    out = stage(*args, **kwargs)
    if out.present():
        return out
    get_run_logger().warning(
        "%s: the cached result names %s, which no longer exists: rebuilding", stage.name, out.marker or out.path
    )
    out = stage.with_options(refresh_cache=True)(*args, **kwargs)
    if not out.present():
        raise RuntimeError(f"{stage.name} finished but its output {out.marker or out.path} does not exist")
    return out
