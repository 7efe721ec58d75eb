"""The cached stages of colocated-train: prompt cache, vocab map, prompt plan.

    keys = stage_keys(config)                    # the data stage's content keys (pure, no corpus walk)
    cache = run_cached(prepare_prompt_cache, config, key=keys.prompt_cache)
    vocab = run_cached(build_vocab_map, config, cache, keys.target_vocab_size, key=keys.vocab_map)
    plan = run_cached(record_plan, config, cache, key=plan_key(config, cache))

Each task is cached across flow runs by its content key (tasks/caching.py), never by a path
string (the cache directory only separates entries, so a hit is always in the configured one): a
changed conversation file, tokenizer, chat template or option gives a new prompt-cache key, which
gives a new vocab-map key; a new dataset size or layout gives a new plan key. Unchanged stages show
as Cached in the UI; one whose output was deleted is rebuilt. Each returns a small ``StageOutput``
(key, path, facts) and publishes a markdown artifact describing what it built.
"""

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from specforge_core.config import RunConfig
from specforge_core.data.prompt_cache import ensure_prompt_cache, open_prompt_cache, prompt_cache_key
from specforge_core.data.tokenize import load_tokenizer
from specforge_core.run.plan import PromptPlan
from specforge_core.capture.target_info import target_vocab_size
from specforge_core.data.vocab import ensure_vocab_map, vocab_map_key
from specforge_core.loop.trainer import directory_identity, target_memo_dir
from tasks.caching import StageOutput, stage_cache


@dataclass(frozen=True)
class StageKeys:
    prompt_cache: str
    vocab_map: str
    target_vocab_size: int


def stage_keys(config: RunConfig) -> StageKeys:
    """The content keys of the prompt cache and vocab map, from the data stage's own key functions.

    Hashes the source bytes (memoised by the data stage) and the tokenizer; builds nothing."""
    tokenizer = load_tokenizer(config)
    cache_key = prompt_cache_key(config, tokenizer)
    V = target_vocab_size(config, tokenizer)
    return StageKeys(cache_key, vocab_map_key(cache_key, V, config.draft.draft_vocab_size), V)


def _plan(config: RunConfig, cache: StageOutput) -> PromptPlan:
    return PromptPlan.from_config(config, cache.facts["train_rows"], topology=config.topology)


def plan_key(config: RunConfig, cache: StageOutput) -> str:
    """sha256 of the plan record: the plan depends on the dataset size and layout, not the content."""
    return _plan(config, cache).key


def _cache_dir(parameters: dict) -> str:
    return parameters["config"].data.cache_dir


def _table(rows: dict) -> str:
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows.items())


@task(name="prepare_prompt_cache", **stage_cache("prompt-cache", location=_cache_dir))
def prepare_prompt_cache(config: RunConfig, key: str) -> StageOutput:
    """Tokenize the conversations into the content-addressed Arrow prompt cache (or open it)."""
    cache = ensure_prompt_cache(config, load_tokenizer(config))
    if cache.key != key:
        raise RuntimeError(
            f"the prompt cache was built under key {cache.key[:12]}…, not {key[:12]}…: the data or the "
            "tokenizer changed while this flow run was starting; run it again"
        )
    facts = {"train_rows": cache.train.num_rows, "eval_rows": cache.eval.num_rows,
             "dropped": cache.meta.get("dropped"), "built": cache.built,
             # hashed once here and remembered, so the ranks' resume check is a stat per file
             "target_fingerprint": directory_identity(config.model.target, memo_dir=target_memo_dir(config))}
    create_markdown_artifact(
        key="prompt-cache",
        markdown=f"## Prompt cache\n\n{_table({'key': f'`{key[:16]}…`', 'path': f'`{cache.path}`', **facts})}\n",
        description="tokenized conversations with loss masks (content-keyed)",
    )
    return StageOutput(key=key, path=str(cache.path), facts=facts)


@task(name="build_vocab_map", **stage_cache("vocab-map", location=_cache_dir))
def build_vocab_map(config: RunConfig, prompt_cache: StageOutput, target_vocab: int, key: str) -> StageOutput:
    """Select the draft vocabulary (d2t/t2d) from the prompt cache's supervised tokens."""
    vm = ensure_vocab_map(config, open_prompt_cache(prompt_cache.path), target_vocab)
    if vm.key != key and not config.draft.vocab_map_path:
        raise RuntimeError(f"the vocab map was built under key {vm.key[:12]}…, not {key[:12]}…")
    facts = {"V": target_vocab, "Vd": config.draft.draft_vocab_size, "vocab_key": vm.key,
             "coverage": None if vm.coverage is None else round(vm.coverage, 4), "built": vm.built}
    create_markdown_artifact(
        key="vocab-map",
        markdown=f"## Draft vocabulary map\n\n{_table({'key': f'`{key[:16]}…`', 'path': f'`{vm.path}`', **facts})}\n"
        "\ncoverage = share of supervised tokens the draft vocabulary can predict.\n",
        description="d2t/t2d: which target tokens the draft predicts",
    )
    return StageOutput(key=key, path=str(vm.path), facts=facts)


@task(name="record_plan", **stage_cache("prompt-plan", location=_cache_dir))
def record_plan(config: RunConfig, prompt_cache: StageOutput, key: str) -> StageOutput:
    """Record plan.json: seed, epochs, islands, shards and horizon, before any training."""
    plan = _plan(config, prompt_cache)
    path = plan.save(Path(config.data.cache_dir) / "plans" / f"{key}.json")
    derived = plan.to_json()["derived"]
    facts = {"dataset_size": plan.dataset_size, "world_size": plan.world_size, "tp_size": plan.tp_size,
             "plan_key": plan.key, **derived}
    create_markdown_artifact(
        key="training-plan",
        markdown=f"## Prompt plan\n\n{_table({'key': f'`{key[:16]}…`', 'path': f'`{path}`', **facts})}\n",
        description="which rank trains which prompt, for how many optimizer steps",
    )
    return StageOutput(key=key, path=str(path), facts=facts)
