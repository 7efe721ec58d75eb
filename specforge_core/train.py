"""Train an EAGLE3 draft, colocated: every rank captures its own target batch on demand and trains.

    torchrun --standalone --nproc_per_node 2 -m specforge_core.train --config examples/tiny-cpu.yaml
    python -m specforge_core.train --config C.yaml training.max_steps=20        # one process, CPU is fine
    torchrun ... -m specforge_core.train --config C.yaml --plan runs/x/plan.json  # a recorded plan

``deployment.nproc_per_node × nnodes`` must equal the number of ranks torchrun starts. Lifecycle:
parse → build (tokenizer, prompt cache, target + capture backend, vocab map, draft, plan) →
train (resume if the run has checkpoints, train to the plan's horizon, save) → close. Rank 0
holds ``<output.dir>/RUN.lock`` for the whole run, prints ``step=i/N loss=...`` lines and writes
``metrics.jsonl``; checkpoints go to ``<output.dir>/checkpoints``. Exit code 2 on a
configuration, data, model, resume or checkpoint error (the message says where and what to do).

Without ``--plan`` the plan is built from the config and the prompt cache and recorded as
``<output.dir>/plan.json`` when the run starts fresh; with ``--plan`` the recorded plan must be
the one this config and data give.
"""

import argparse
import contextlib
import sys
from functools import partial
from pathlib import Path

from specforge_core.errors import ConfigError, SpecForgeError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML run config")
    ap.add_argument("--plan", help="a recorded plan.json (default: build it from the config and data)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=20")
    return ap.parse_args(argv)


def load_plan(cfg, dataset_size: int, plan_path: str | None):
    """The run's prompt plan: the recorded one (checked against config + data) or a fresh one."""
    from specforge_core.run.plan import PromptPlan

    expected = PromptPlan.from_config(cfg, dataset_size)
    if plan_path is None:
        return expected
    recorded = PromptPlan.load(plan_path)
    diffs = recorded.differences(expected)
    if diffs:
        raise ConfigError(
            "the recorded plan was made for another configuration or dataset (recorded → this run): "
            + "; ".join(diffs),
            where=plan_path,
            fix="record the plan again for this config, or run with the config and data it was made for",
        )
    return recorded


def build(cfg, d, plan_path: str | None):
    """Every piece of the run on this rank; returns ``(trainer, backend)``."""
    import torch

    from specforge_core.capture import build_capture_backend
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.drafts.eagle3.serving import save_draft_checkpoint_files, warm_start_draft
    from specforge_core.drafts.eagle3.config import (
        draft_config_from_target,
        load_draft_config,
        serving_config_dict,
    )
    from specforge_core.drafts.eagle3.model import Eagle3DraftModel
    from specforge_core.drafts.eagle3 import eagle3_loss, summarize_metrics
    from specforge_core.runtime.checkpoint import latest_checkpoint
    from specforge_core.runtime.rollout import RolloutStream
    from specforge_core.runtime.trainer import Trainer, directory_identity, training_contract
    from specforge_core.data.vocab import ensure_vocab_map, load_vocab_map

    t = cfg.training
    # Every rank draws the same initial draft: FSDP keeps each rank's slice of its own copy.
    torch.manual_seed(t.seed)
    cache = ensure_prompt_cache(cfg, load_tokenizer(cfg))  # one process builds, the others wait
    given_config = load_draft_config(cfg.draft.config_path) if cfg.draft.config_path else None
    backend = build_capture_backend(cfg, rank=d.rank, local_rank=d.local_rank, draft_config=given_config)
    draft_config = given_config or draft_config_from_target(
        backend.target_config, cfg.draft.draft_vocab_size, list(backend.layer_ids), fc_norm=cfg.draft.fc_norm
    )
    if cfg.draft.vocab_map_path:
        vocab = load_vocab_map(cfg.draft.vocab_map_path, backend.vocab_size, draft_config.draft_vocab_size)
    else:
        vocab = ensure_vocab_map(cfg, cache, backend.vocab_size)
    # A warm start keeps its exported dtype here; sharding makes the trainable weights fp32 masters.
    if cfg.draft.init_from:
        draft = warm_start_draft(cfg.draft.init_from, draft_config)
    else:
        draft = Eagle3DraftModel(draft_config)
    draft.load_embedding(backend.embed_weight)
    draft.set_vocab_map(vocab.d2t, vocab.t2d)
    if t.compile and d.device.type == "cuda":
        from specforge_core.runtime.compile import compile_pointwise

        compile_pointwise(draft)

    rows = cache.rows("train")  # pyarrow only: no datasets/pandas import in the ranks
    plan = load_plan(cfg, len(rows), plan_path)
    if d.is_main and plan_path is None and latest_checkpoint(cfg.output.dir) is None:
        plan.save(Path(cfg.output.dir) / "plan.json")
    contract = training_contract(
        cfg,
        plan,
        prompt_cache=cache.key,
        vocab_map=vocab.key,
        target=directory_identity(cfg.model.target),
        draft_config=serving_config_dict(draft_config),
    )
    objective = partial(
        eagle3_loss,
        lm_head_weight=backend.lm_head_weight,
        ttt_length=t.ttt_length,
        decay=t.ploss_decay,
        backend=cfg.draft.attention_backend,
        vocab_chunk=cfg.capture.teacher_chunk_size,
    )
    trainer = Trainer(
        cfg,
        d,
        plan,
        draft=draft,
        objective=objective,
        derive=partial(summarize_metrics, decay=t.ploss_decay),
        open_stream=lambda start: RolloutStream.from_plan(
            plan, d.rank, rows, backend, start_sample=start, token_budget=t.token_budget
        ),
        contract=contract,
        write_draft_files=partial(save_draft_checkpoint_files, draft),
    )
    return trainer, backend


@contextlib.contextmanager
def run_lock(cfg, d):
    """Rank 0 holds ``<output.dir>/RUN.lock`` for the run; every rank fails if it cannot."""
    from specforge_core.runtime.distributed import broadcast_object
    from specforge_core.runtime.run_lock import RunLock

    lock, error = None, None
    if d.is_main:
        try:
            lock = RunLock(cfg.output.dir, wait_s=None if cfg.output.on_busy == "fail" else float("inf")).acquire()
            if lock.took_over is not None:
                print(f"took over the stale lock of {lock.took_over.describe()}", flush=True)
        except SpecForgeError as e:
            error = e
    error = broadcast_object(d, error)
    if error is not None:
        raise error
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def check_world(cfg, d) -> None:
    if cfg.deployment.world_size != d.world_size:
        raise ConfigError(
            f"torchrun started {d.world_size} ranks but the config plans for "
            f"deployment.nproc_per_node × nnodes = {cfg.deployment.world_size}",
            where="deployment.nproc_per_node",
            fix=f"set deployment.nproc_per_node (× nnodes) to {d.world_size}, or launch that many ranks",
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specforge_core.runtime.host import keep_freed_memory, prefer_passive_omp_wait

    prefer_passive_omp_wait()  # before torch is imported (runtime/host.py says why)
    # Before anything touches CUDA: the allocator reads its configuration once, at initialisation.
    from specforge_core.runtime.distributed import close_distributed, enable_expandable_segments, init_distributed

    enable_expandable_segments()
    try:
        from specforge_core.config import load_config

        cfg = load_config(args.config, args.overrides)
        d = init_distributed(cfg.capture.device)
        if d.device.type == "cpu":
            keep_freed_memory()
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_world(cfg, d)
        from specforge_core.runtime.preflight import check_run_inputs

        check_run_inputs(cfg)  # config files only: refuses mismatches before anything is written
        with run_lock(cfg, d):
            trainer, backend = build(cfg, d, args.plan)
            try:
                trainer.fit()
            finally:
                backend.close()
    except SpecForgeError as e:
        print(f"error (rank {d.rank}): {e}", file=sys.stderr)
        return 2
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
