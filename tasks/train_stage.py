"""The train stage: one torchrun per node running ``specforge_core.train``, resumable by flow-run state.

    trained = run_cached(train, config, cache, vocab, plan, run_dir=str(run_dir),
                         key=f"{flow_run_id}-{plan.key}")

Run directory: ``<output.dir>/<slug of the flow-run name>-<first 8 hex of its id>`` (``run_dir_for``). A retry of
the flow run (``prefect flow-run retry``) keeps its id, so it finds its own checkpoints there and the
trainer resumes from the latest one; a new flow run starts a new directory. The task:

1. copies plan.json into the run directory and writes the run manifest ``run.json`` (the resolved
   config with ``output.dir`` = the run directory, credentials masked; the prompt cache, vocab map
   and plan the upstream stages resolved, each as key + path) and ``config.yaml`` for reading;
2. on a retry, compares the plan recorded in the latest checkpoint with this plan and fails, naming
   each difference, before launching anything (the trainer checks the full contract again);
3. runs ``python -m torch.distributed.run ... -m specforge_core.train --manifest run.json`` through
   ``tasks.process_group`` (own session, streamed logs, progress + metrics artifacts, every
   process of the tree stopped on cancel or crash); the ranks open the recorded inputs by path
   and never re-read the sources, so they need no storage credentials;
4. returns the newest checkpoint; cached per (flow run, plan) so a retry after a later stage failed
   shows train as Cached instead of launching torchrun for nothing.

``dry_run_layout`` (the flow's ``dry_run=True``) replaces this task: the dry run of the recorded
prompt cache and plan, logged and published as the ``dry-run`` artifact; nothing is launched.

Several nodes: ``deployment.nnodes > 1`` with ``deployment.rdzv_endpoint`` gives a c10d rendezvous
command, and ``deployment.launcher: <name>`` puts the worker operator's launch prefix
``SPECFORGE_LAUNCHER_<NAME>`` (e.g. ``srun --nodes=4 --ntasks-per-node=1``) in front of it to start it
once per node. A run only names a launcher; the command comes from the worker's own environment,
and one that the run's or its deployment's job variables set is refused (``launch_prefix``);
docs/deploy.md has the Slurm and JobSet recipes and the trust model.
"""

import json
import os
import re
import shlex
import shutil
import sys
import unicodedata
from collections.abc import Mapping
from pathlib import Path

import yaml
from prefect import task
from prefect.logging import get_run_logger

from specforge_core.config import RunConfig, dump_config
from specforge_core.errors import ResumeError
from specforge_core.io import atomic_write_text
from specforge_core.run.directory import RunDir, shared_compile_cache
from specforge_core.run.manifest import Ref, RunManifest
from specforge_core.system.compile import CACHE_ENV
from specforge_core.loop.checkpoint import checkpoint_step, contract_differences, latest_checkpoint, read_train_state
from specforge_core.loop.run_lock import make_output_dir
from tasks.caching import StageOutput, stage_cache
from tasks.process_group import kill_recorded_tree, run_process_group

LAUNCHER_ENV = "SPECFORGE_LAUNCHER_"
RETIRED_PREFIX_ENV = "SPECFORGE_LAUNCH_PREFIX"  # a free-form command any job variable could set


def run_dir_for(output_dir: str, flow_run_name: str, flow_run_id: str) -> Path:
    """Where one flow run trains: stable across retries of that run, new for every new run, and
    always one directory directly under ``output_dir``.

    The flow-run name is anyone's choice through the API (``prefect deployment run --flow-run-name``),
    so only a slug of it is used: ASCII letters, digits, ``_`` and ``-`` (accents folded, other
    characters and ``..`` or ``/`` turned into ``-``), at most 48 characters, ``run`` when nothing
    is left. The first 8 hex digits of the flow-run id keep two runs whose names slug alike apart.
    """
    folded = unicodedata.normalize("NFKD", str(flow_run_name)).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", folded).strip("-_")[:48].strip("-_") or "run"
    run_id = re.sub(r"[^0-9a-f]", "", str(flow_run_id).lower())[:8]
    if not run_id:
        raise ValueError(f"flow-run id {flow_run_id!r} has no hex digits to name its run directory by")
    return Path(output_dir) / f"{slug}-{run_id}"


def launcher_variable(name: str) -> str:
    """The worker's environment variable holding launcher ``name``'s prefix (``srun-2node`` →
    ``SPECFORGE_LAUNCHER_SRUN_2NODE``)."""
    return LAUNCHER_ENV + name.upper().replace("-", "_")


def launch_prefix(name: str | None, environ: Mapping[str, str], run_env: Mapping[str, str]) -> list[str]:
    """The words put in front of torchrun: launcher ``name`` as the worker's ``environ`` defines it.

    ``run_env`` is what the flow run's and its deployment's job variables put into that environment
    (a process worker merges them in). A launcher variable or the retired free-form
    ``SPECFORGE_LAUNCH_PREFIX`` there is refused: whoever may set job variables through the Prefect
    API could otherwise choose the command the worker runs. Raises ``ValueError`` naming the
    variable and the fix; ``name=None`` gives no prefix.
    """
    from_run = sorted(k for k in run_env if k.startswith(LAUNCHER_ENV) or k == RETIRED_PREFIX_ENV)
    if from_run:
        raise ValueError(
            f"the run's job variables set {', '.join(from_run)}: a launch prefix comes only from the "
            "worker's own environment; remove it from the deployment's or run's job_variables.env and "
            "name a launcher the worker defines in deployment.launcher (docs/deploy.md, 'Several nodes')"
        )
    if RETIRED_PREFIX_ENV in environ:
        raise ValueError(
            f"{RETIRED_PREFIX_ENV} is no longer read: define the prefix as SPECFORGE_LAUNCHER_<NAME> in the "
            "worker's environment and set deployment.launcher to <name> (docs/deploy.md, 'Several nodes')"
        )
    if name is None:
        return []
    variable = launcher_variable(name)
    if variable not in environ:
        defined = sorted(k[len(LAUNCHER_ENV):].lower().replace("_", "-") for k in environ if k.startswith(LAUNCHER_ENV))
        raise ValueError(
            f"deployment.launcher={name!r} is not defined on this worker (defined: {defined or 'none'}); "
            f"export {variable}='<command prefix>' before `prefect worker start`, or pick a defined one"
        )
    return shlex.split(environ[variable])


def run_job_variable_env() -> dict[str, str]:
    """The environment the current flow run's own and its deployment's job variables set ({} outside
    a deployment run): what ``launch_prefix`` must not take a launcher from."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment, flow_run

    env = dict((flow_run.job_variables or {}).get("env") or {})
    if deployment.id:
        with get_client(sync_client=True) as client:
            env.update((client.read_deployment(deployment.id).job_variables or {}).get("env") or {})
    return env


def torchrun_command(config: RunConfig, manifest_path: Path, rdzv_id: str,
                     prefix: list[str] | None = None) -> list[str]:
    """The worker command for this node: ``--standalone`` on one node, c10d rendezvous on several,
    after ``prefix`` (``launch_prefix``'s words that start it once per node)."""
    d = config.deployment
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={d.nproc_per_node}"]
    if d.nnodes == 1:
        cmd.append("--standalone")
    else:
        if not d.rdzv_endpoint:
            raise ValueError(
                f"deployment.nnodes={d.nnodes} needs deployment.rdzv_endpoint (host:port of the first node)"
            )
        cmd += [f"--nnodes={d.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={d.rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    cmd += ["-m", "specforge_core.train", "--manifest", str(manifest_path)]
    return (prefix or []) + cmd


def torchrun_env(config: RunConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment: ``environ`` (the worker's) plus, where it sets neither,
    ``OMP_NUM_THREADS`` (each rank's share of the cores) and ``TORCHINDUCTOR_CACHE_DIR`` =
    ``<output.dir>/compile-cache`` (``shared_compile_cache``): one compile cache for every flow run
    under the same ``output.dir``, so a retry or a later run of the same recipe (a scheduled
    retraining) starts from the graphs and kernels an earlier run compiled. Ranks a launcher
    starts without the worker's environment keep their run directory's cache."""
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.deployment.nproc_per_node)))
    env.setdefault(CACHE_ENV, str(shared_compile_cache(config.output.dir)))
    return env


def check_checkpoint_plan(ckpt: Path, plan_path: Path) -> None:
    """Fail before launching if the checkpoint this run would resume was trained under another plan
    (the same comparison the trainer's resume check makes, on the plan part of the contract)."""
    recorded = (read_train_state(ckpt).get("contract") or {}).get("plan")
    if recorded is None:
        return
    diffs = contract_differences(recorded, json.loads(plan_path.read_text()))
    if diffs:
        raise ResumeError(
            "this flow run's checkpoint was trained under a different prompt plan:\n    " + "\n    ".join(diffs),
            where=str(ckpt),
            fix="a retry must keep the run's data and layout; restore them, or start a new flow run "
            "(prefect deployment run ...) which trains from scratch in a new directory",
        )


def trainer_config(config: RunConfig, run_dir: Path, vocab: StageOutput | None) -> RunConfig:
    """The run config as the trainer and the evaluator see it: this run's directory, this vocab map."""
    out = config.model_copy(deep=True)
    out.output.dir = str(run_dir)
    if vocab is not None:
        out.draft.vocab_map_path = vocab.path
    return out


def record_run(config: RunConfig, run: RunDir, cache: StageOutput, vocab: StageOutput | None,
               plan: StageOutput) -> Path:
    """Write ``run.json`` (what the ranks open) and ``config.yaml`` (for people) into the run dir."""
    resolved = dump_config(trainer_config(config, run.root, vocab))
    atomic_write_text(run.config, yaml.safe_dump(resolved, sort_keys=False))
    return RunManifest(
        config=resolved,
        prompt_cache=Ref(cache.key, cache.path),
        plan=Ref(plan.facts.get("plan_key", plan.key), str(run.plan)),
        vocab_map=None if vocab is None else Ref(vocab.facts.get("vocab_key", vocab.key), vocab.path),
    ).save(run.manifest)


@task(name="dry_run")
def dry_run_layout(config: RunConfig, prompt_cache: StageOutput, plan: StageOutput) -> dict:
    """Check and show the layout train would launch (launch/dry_run.py), on the recorded inputs; launch nothing."""
    from prefect.artifacts import create_markdown_artifact

    from specforge_core.data.prompt_cache import open_prompt_cache
    from specforge_core.launch.dry_run import DatasetSize, dry_run

    rows = open_prompt_cache(prompt_cache.path).rows("train")
    report = dry_run(config, DatasetSize.of_prompt_cache(rows, prompt_cache.path), plan_path=plan.path)
    logger = get_run_logger()
    for line in report.lines():
        logger.info(line)
    create_markdown_artifact(
        key="dry-run",
        markdown="## Dry run: the layout train would launch\n\n```\n" + "\n".join(report.lines()) + "\n```\n",
        description="topology, plan, SGLang pools and the memory estimate per GPU; nothing was launched",
    )
    report.check_fits(config)
    return report.as_dict()


@task(name="train", **stage_cache("train", location=lambda p: p["run_dir"]))
def train(config: RunConfig, prompt_cache: StageOutput, vocab_map: StageOutput | None, plan: StageOutput,
          run_dir: str, key: str) -> StageOutput:
    """Train the draft under torchrun (resuming this flow run's latest checkpoint, if any)."""
    logger = get_run_logger()
    prefix = launch_prefix(config.deployment.launcher, os.environ, run_job_variable_env())
    run = RunDir(run_dir)
    make_output_dir(run.root)
    shutil.copyfile(plan.path, run.plan)

    # A flow-run process killed by SIGKILL (OOM) leaves its torchrun tree running: the worker
    # reports the run Crashed, but nothing stopped the ranks, which still hold the run directory.
    stale = kill_recorded_tree(run.process_tree)
    if stale:
        logger.warning("stopped %d training processes left running by an earlier attempt of this run", stale)

    resumed_from = None
    ckpt = latest_checkpoint(run.root)
    if ckpt is not None:
        check_checkpoint_plan(ckpt, run.plan)
        resumed_from = checkpoint_step(ckpt)
        logger.info("resuming from %s (optimizer step %d of %d)", ckpt, resumed_from,
                    plan.facts["total_optimizer_steps"])

    manifest = record_run(config, run, prompt_cache, vocab_map, plan)
    env = torchrun_env(config, os.environ)
    outcome = run_process_group(
        torchrun_command(config, manifest, rdzv_id=key[:32], prefix=prefix),
        env=env,
        log_path=run.train_log,
        tree_path=run.process_tree,
        metrics_path=run.metrics,
    )
    final = latest_checkpoint(run.root)
    if final is None:
        raise RuntimeError(f"training exited 0 but wrote no complete checkpoint under {run.checkpoints}")
    facts = {"run_dir": str(run.root), "checkpoint": str(final), "step": checkpoint_step(final),
             "total_steps": plan.facts["total_optimizer_steps"], "resumed_from_step": resumed_from,
             "first_logged_step": outcome.first_step}
    logger.info("trained to optimizer step %d (%s)", facts["step"], final)
    return StageOutput(key=key, path=str(final), marker=str(final / "COMPLETE"), facts=facts)
