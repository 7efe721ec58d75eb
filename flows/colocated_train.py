"""The `colocated-train` flow: conversations → prompt cache → vocab map → plan → train → validate.

    python -m flows.colocated_train --config examples/tiny-cpu.yaml [section.key=value ...]
    python -m flows.colocated_train --config examples/gpu/qwen3-8b-1gpu.yaml --dry-run
    prefect deployment run colocated-train/default --watch            # docs/deploy.md

Two parameters: the run config model (`specforge_core.config.RunConfig`), which the Prefect UI
renders as a form, and `dry_run`: run the data stages (cached as ever), then, instead of train and
validate, the dry run of the recorded prompt cache and plan (`tasks.train_stage.dry_run_layout`:
topology, plan, SGLang pools, memory per GPU, the launch's own refusals), which is returned and
published as the `dry-run` artifact; nothing is launched. Run locally (ephemeral API) or through a deployment; resume is driven by the
flow run's state: `prefect flow-run retry <id>` on a failed or crashed run shows the data stages as
Cached and restarts train, which resumes from this run's latest checkpoint after checking the
plan. Scheduled retraining (the nightly deployment) rebuilds only the stages whose content keys
changed, warm-starts from the promoted draft when `draft.init_from` names it, and promotes the
new draft only if its measured acceptance length beats the promoted one by
`validation.promote_margin`.

No `from __future__ import annotations` here: `flow.serve` validates the pydantic parameter from
the pickled flow and fails on postponed annotations (seen with Prefect 3.9).
"""

import argparse
import sys
from pathlib import Path

from prefect import flow
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from specforge_core.config import RunConfig, load_config
from specforge_core.drafts import check_config, get_family
from specforge_core.errors import SpecForgeError
from tasks.caching import run_cached
from tasks.data_stages import build_vocab_map, plan_key, prepare_prompt_cache, record_plan, stage_keys
from tasks.promotion import promote
from tasks.train_stage import dry_run_layout, run_dir_for, train
from tasks.validation import validate


def _warm_start(config: RunConfig) -> RunConfig:
    """A warm start from the promoted draft before any draft was promoted is a cold start."""
    init, promoted = config.draft.init_from, config.validation.promoted_dir
    if init and promoted and Path(init).resolve() == Path(promoted).resolve() and not Path(init).is_dir():
        get_run_logger().info("no promoted draft at %s yet: training from scratch", init)
        config = config.model_copy(deep=True)
        config.draft.init_from = None
    return config


@flow(name="colocated-train", description="Online, colocated training of a draft model (EAGLE3 / "
      "EAGLE-3.1, DFlash / DFlash2, DSpark: draft.family): cached data stages, torchrun training, "
      "validation by measured acceptance length.")
def colocated_train(config: RunConfig, dry_run: bool = False) -> dict:
    """Train a draft of the family ``config.draft.family`` for ``config.model.target`` on
    ``config.data``; returns where the draft, the report and the acceptance lengths are.
    ``dry_run``: stop after the data stages with the layout the training would launch (the dry
    run's report)."""
    config = _warm_start(check_config(config))  # the family's own rules, before any stage writes
    run_dir = run_dir_for(config.output.dir, flow_run.name, flow_run.id)

    keys = stage_keys(config)
    cache = run_cached(prepare_prompt_cache, config, key=keys.prompt_cache)
    vocab = None
    if get_family(config.draft.family).uses_vocab_map:
        vocab = run_cached(build_vocab_map, config, cache, keys.target_vocab_size, key=keys.vocab_map)
    plan = run_cached(record_plan, config, cache, key=plan_key(config, cache))
    if dry_run:
        return dry_run_layout(config, cache, plan)
    trained = run_cached(train, config, cache, vocab, plan, run_dir=str(run_dir), key=f"{flow_run.id}-{plan.key}")
    if not config.validation.enabled:
        return {"run_dir": str(run_dir), "checkpoint": trained.path}
    report = validate(config, vocab, trained, run_dir=str(run_dir))
    if config.validation.promoted_dir:
        report["promotion"] = promote(config, report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.colocated_train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML run config (examples/*.yaml)")
    ap.add_argument("--dry-run", action="store_true", help="the data stages, then the dry run instead of training")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=10")
    args = ap.parse_args(argv)
    try:
        config = check_config(load_config(args.config, args.overrides))
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = colocated_train(config, dry_run=args.dry_run, return_state=True)
    if not state.is_completed():
        print(f"colocated-train ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    for k, v in state.result().items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
