"""Wire one rank's training run: resolve its inputs once, then build backend, draft, objective, trainer.

    launch_rank(cfg, d, manifest=manifest)                       # python -m specforge_core.train
    # which is:
    topology = Topology.launched(cfg, d.world_size)              # cfg.topology, once torchrun's world is checked
    checked = check_run_inputs(cfg)                              # preflight, reused below
    inputs = inputs_from_manifest(manifest, d, checked, cfg=cfg, topology=topology)  # the flow resolved everything
    inputs = resolve_inputs(cfg, d, checked, topology)           # a run started by hand
    trainer, backend = build_training(cfg, d, inputs, checked)
    trainer.fit(); backend.close()

``python -m specforge_core.train`` runs exactly this, and the benchmarks build their draft and
objective through :func:`build_draft` and :func:`build_objective`, so what they time is the wiring
that ships.

Resolving inputs. From a manifest (``run.json``): each rank opens the recorded prompt cache, vocab
map and plan by path and checks their keys once (the cache's meta key, the vocab map's sidecar
key, the plan record's sha256); nothing is re-hashed. By hand: rank 0 hashes the sources, builds
or finds the cache and the vocab map and broadcasts where they are; the other ranks open them
there (never re-reading a source while rank 0 holds a collective); rank 0 records ``run.json``
(fresh starts only: a resume writes nothing before its checks have passed).
Either way the plan is compared once with the plan this config, data and launched topology give;
from then on the plan carries the topology (``plan.topology``) to the capture backend and the
rollout stream, and nothing derives it again.
"""

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from specforge_core.errors import ConfigError
from specforge_core.run.directory import RunDir
from specforge_core.run.manifest import Ref, RunManifest
from specforge_core.run.plan import PromptPlan
from specforge_core.run.topology import Topology


@dataclass
class RunInputs:
    """What a rank trains from: resolved once per run (the plan carries the topology)."""

    prompt_cache: Any  # data.prompt_cache.PromptCache
    rows: Any  # its train split as pyarrow rows (no datasets/pandas import on the ranks)
    vocab: Any | None  # data.vocab.VocabMap, or None for a family without a draft vocabulary
    plan: PromptPlan


def check_plan_against_config(cfg, plan: PromptPlan, topology: Topology, dataset_size: int, where: str) -> None:
    """The one plan comparison: the recorded plan must be the one this config, data and world give."""
    expected = PromptPlan.from_config(cfg, dataset_size, topology=topology)
    diffs = plan.differences(expected)
    if diffs:
        raise ConfigError(
            "the recorded plan was made for another configuration or dataset (recorded → this run): "
            + "; ".join(diffs),
            where=where,
            fix="record the plan again for this config, or run with the config and data it was made for",
        )


def _check_key(what: str, recorded: str, found: str, where: str) -> None:
    if recorded != found:
        raise ConfigError(
            f"the {what} at this path has key {found[:12]}…, the run manifest recorded {recorded[:12]}…",
            where=where,
            fix="run the flow again (it re-resolves the inputs), or restore the recorded files",
        )


def inputs_from_manifest(manifest: RunManifest, d, checked, *, cfg, topology: Topology) -> RunInputs:
    """Open the manifest's prompt cache, vocab map and plan by path; check each key once, and the
    plan against the launch's ``topology``."""
    from specforge_core.data.prompt_cache import open_prompt_cache
    from specforge_core.data.vocab import load_vocab_map

    cache = open_prompt_cache(manifest.prompt_cache.path)
    _check_key("prompt cache", manifest.prompt_cache.key, cache.key, manifest.prompt_cache.path)
    vocab = None
    if checked.family.uses_vocab_map:
        if manifest.vocab_map is None:
            raise ConfigError("the run manifest records no vocab map, which this draft family needs",
                              where="run.json: vocab_map", fix="run the flow again to record one")
        vocab = load_vocab_map(manifest.vocab_map.path, checked.vocab_size, cfg.draft.draft_vocab_size)
        _check_key("vocab map", manifest.vocab_map.key, vocab.key, manifest.vocab_map.path)
    plan = PromptPlan.load(manifest.plan.path, topology=topology)  # carries the launch's topology
    _check_key("plan", manifest.plan.key, plan.key, manifest.plan.path)
    rows = cache.rows("train")
    check_plan_against_config(cfg, plan, topology, len(rows), manifest.plan.path)
    return RunInputs(cache, rows, vocab, plan)


def resolve_inputs(cfg, d, checked, topology: Topology, *, plan_path: str | None = None) -> RunInputs:
    """Resolve a run started without a manifest (rank 0 builds or finds, the others open) for the
    launch's ``topology``; on a fresh start rank 0 records ``plan.json`` and ``run.json``."""
    from specforge_core.config import dump_config
    from specforge_core.data.prompt_cache import ensure_prompt_cache, open_prompt_cache
    from specforge_core.data.vocab import ensure_vocab_map, load_vocab_map
    from specforge_core.loop.checkpoint import latest_checkpoint
    from specforge_core.system.distributed import broadcast_object

    family = checked.family
    found, error = None, None
    if d.is_main:
        try:
            cache = ensure_prompt_cache(cfg, checked.tokenizer)
            vocab = ensure_vocab_map(cfg, cache, checked.vocab_size) if family.uses_vocab_map else None
            found = (str(cache.path), None if vocab is None else str(vocab.path))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    found, error = broadcast_object(d, (found, error))
    if error is not None:
        raise error
    if not d.is_main:
        cache = open_prompt_cache(found[0])
        vocab = None if found[1] is None else load_vocab_map(found[1], checked.vocab_size, cfg.draft.draft_vocab_size)
    rows = cache.rows("train")
    run = RunDir(cfg.output.dir)
    if plan_path is None:
        plan = PromptPlan.from_config(cfg, len(rows), topology=topology)
    else:
        plan = PromptPlan.load(plan_path, topology=topology)
        check_plan_against_config(cfg, plan, topology, len(rows), plan_path)
    if d.is_main and latest_checkpoint(run.root) is None:  # a fresh start; a resume changes no file
        if plan_path is None:
            plan.save(run.plan)
        RunManifest(
            config=dump_config(cfg),
            prompt_cache=Ref(cache.key, str(cache.path)),
            plan=Ref(plan.key, str(plan_path or run.plan)),
            vocab_map=None if vocab is None else Ref(vocab.key, str(vocab.path)),
        ).save(run.manifest)
    return RunInputs(cache, rows, vocab, plan)


def build_draft(cfg, family, backend, vocab, *, draft_config=None, target_config=None):
    """The draft of ``family`` for this target: warm-started from ``draft.init_from`` or freshly
    initialised on the target's device (every rank draws the same initial weights from
    ``training.seed``; a GPU's draw differs from a CPU's), given the
    target's frozen embedding / vocab map, compiled where ``training.compile`` says and with its
    recomputed regions checkpointed where ``training.activation_checkpointing`` says."""
    draft_config = draft_config or family.draft_config(cfg, target_config or backend.target_config, backend.layer_ids)
    torch.manual_seed(cfg.training.seed)
    # A warm start keeps its exported dtype here; sharding makes the trainable weights fp32 masters.
    if cfg.draft.init_from:
        draft = family.warm_start(cfg.draft.init_from, draft_config)
    else:
        # Built on the target's device: on a GPU the initial draw runs there instead of on the CPU
        # followed by a copy (≈ 4 s at a 152k × 4096 vocabulary); vocab map and embedding go in after.
        with torch.device(backend.device):
            draft = family.new_draft(draft_config)
    family.attach_target(cfg, draft, backend, vocab, fresh=not cfg.draft.init_from)
    from specforge_core.system.compile import compile_pointwise
    from specforge_core.system.recompute import recompute_regions

    if cfg.training.compile and backend.device.type == "cuda":
        compile_pointwise(draft)
    if cfg.training.activation_checkpointing:
        recompute_regions(draft)  # after compiling: the backward reruns the compiled regions
    return draft


def build_objective(cfg, family, backend):
    """``objective(draft, batch) -> (loss, sums)`` and ``derive(sums) -> metrics`` of ``family``."""
    return family.objective(cfg, backend), partial(family.summarize, cfg)


def build_training(cfg, d, inputs: RunInputs, checked):
    """Backend, draft, objective and trainer of this rank; returns ``(trainer, backend)``."""
    from specforge_core.capture import build_capture_backend
    from specforge_core.loop.rollout import RolloutStream
    from specforge_core.system.distributed import broadcast_object
    from specforge_core.loop.trainer import Trainer, directory_identity, target_memo_dir, training_contract

    family = checked.family
    backend = build_capture_backend(
        cfg, rank=d.rank, local_rank=d.local_rank, topology=inputs.plan.topology,
        target_config=checked.target_config, layer_ids=checked.layer_ids, last_hidden=family.captures_last_hidden,
    )
    draft_config = checked.draft_config  # preflight made (and checked) it
    draft = build_draft(cfg, family, backend, inputs.vocab, draft_config=draft_config)
    objective, derive = build_objective(cfg, family, backend)
    contract = training_contract(
        cfg,
        inputs.plan,
        prompt_cache=inputs.prompt_cache.key,
        vocab_map=None if inputs.vocab is None else inputs.vocab.key,
        target=broadcast_object(d, directory_identity(cfg.model.target, memo_dir=target_memo_dir(cfg))
                                if d.is_main else None),  # rank 0 hashes; the others wait
        draft_config=family.serving_config(draft_config),
        family_fields=family.contract_fields(cfg),
    )
    plan, rows, budget = inputs.plan, inputs.rows, cfg.training.token_budget
    heldout = None
    if cfg.training.heldout.interval:
        from specforge_core.launch.heldout import HeldOutDecoder, heldout_prompt_ids

        prompts = heldout_prompt_ids(inputs.prompt_cache.rows("eval"), cfg.training.heldout.num_prompts)
        heldout = HeldOutDecoder(cfg, family, draft_config, prompts) if d.is_main else None
    trainer = Trainer(
        cfg,
        d,
        plan,
        draft=draft,
        objective=objective,
        derive=derive,
        open_stream=lambda start: RolloutStream.from_plan(plan, d.rank, rows, backend, start_sample=start,
                                                          token_budget=budget),
        contract=contract,
        write_draft_files=partial(family.save_checkpoint_files, draft),
        loss_is_sum=family.loss_is_sum,
        heldout=heldout,
    )
    return trainer, backend


@contextlib.contextmanager
def hold_run_lock(cfg, d):
    """Rank 0 holds ``<output.dir>/RUN.lock`` for the run; every rank fails if it cannot (and with
    ``output.on_busy: wait`` every rank waits, outside any collective: ``hold_for_ranks``)."""
    from specforge_core.loop.run_lock import hold_for_ranks

    lock = hold_for_ranks(cfg.output.dir, d, on_busy=cfg.output.on_busy)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def launch_rank(cfg, d, *, manifest=None, plan_path: str | None = None) -> None:
    """Preflight, resolve, build and fit on this rank (collective: every rank calls it). The
    topology is resolved here, once, from the launch; the recorded plan is checked against it."""
    from specforge_core.launch.preflight import check_run_inputs
    from specforge_core.system.compile import compile_cache

    started = time.monotonic()
    topology = Topology.launched(cfg, d.world_size)  # torchrun's world must be the config's
    checked = check_run_inputs(cfg)  # config files only: refuses mismatches before anything is written
    with hold_run_lock(cfg, d), compile_cache(RunDir(cfg.output.dir).compile_cache):
        if manifest is not None:
            inputs = inputs_from_manifest(manifest, d, checked, cfg=cfg, topology=topology)
        else:
            inputs = resolve_inputs(cfg, d, checked, topology, plan_path=plan_path)
        trainer, backend = build_training(cfg, d, inputs, checked)
        print(f"rank {d.rank}/{d.world_size} started on {d.device}: target and draft built in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        try:
            trainer.fit()
        finally:
            backend.close()
