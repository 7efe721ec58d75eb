"""The run manifest, ``run.json``: what a run trains from, resolved once, opened by path everywhere else.

    manifest = RunManifest(config=dump_config(cfg), prompt_cache=Ref(key, path), vocab_map=Ref(...),
                           plan=Ref(plan.key, run.plan))
    manifest.save(run.manifest)
    python -m specforge_core.train --manifest RUN/run.json         # what the flow's train task runs

The flow (or, for a run started by hand, rank 0 of the trainer) resolves the inputs — hashes the
source files into the prompt cache's content key, builds or finds the cache, the vocab map and the
plan — and records each as a ``{key, path}`` pair beside the resolved config. The training ranks
then open the recorded paths and check each key once (the cache's meta key, the vocab map's
sidecar key, the plan record's sha256); they never re-read or re-hash the sources. The config in
the manifest has credentials masked: the ranks read only local cache files, so they need none.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specforge_core.errors import ConfigError
from specforge_core.io import atomic_write_json

MANIFEST_FORMAT = "specforge-run/1"


@dataclass(frozen=True)
class Ref:
    """One resolved input: its content key and where it lives."""

    key: str
    path: str


@dataclass(frozen=True)
class RunManifest:
    config: dict
    prompt_cache: Ref
    plan: Ref
    vocab_map: Ref | None = None  # None: the draft family uses the full target vocabulary

    def to_json(self) -> dict:
        out = {"format": MANIFEST_FORMAT, **asdict(self)}
        return out

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_json(), durable=True)

    @classmethod
    def load(cls, path: str | Path) -> "RunManifest":
        path = Path(path)
        fix = "record the run again (run the flow, or python -m specforge_core.train --config C.yaml)"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("the run manifest does not exist", where=str(path), fix=fix) from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"the run manifest is unreadable ({e})", where=str(path), fix=fix) from None
        if not isinstance(record, dict) or record.get("format") != MANIFEST_FORMAT:
            got = record.get("format") if isinstance(record, dict) else None
            raise ConfigError(f"not a {MANIFEST_FORMAT} manifest (format {got!r})", where=str(path), fix=fix)
        try:
            vocab = record.get("vocab_map")
            return cls(
                config=record["config"],
                prompt_cache=Ref(**record["prompt_cache"]),
                plan=Ref(**record["plan"]),
                vocab_map=Ref(**vocab) if vocab else None,
            )
        except (KeyError, TypeError) as e:
            raise ConfigError(f"the run manifest lacks a field ({e})", where=str(path), fix=fix) from None
