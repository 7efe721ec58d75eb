"""Prefect caching for the file-producing stages: keyed by content, trusted only while the file is there.

    @task(cache_key_fn=content_key("prompt-cache"), persist_result=True)
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
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import Task
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger


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
