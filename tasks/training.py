"""The train stage: one torchrun per node running ``specforge_core.train``, resumable by flow-run state.

    trained = run_cached(train, config, cache, vocab, plan, run_dir=str(run_dir),
                         key=f"{flow_run_id}-{plan.key}")

Run directory: ``<output.dir>/<flow-run name>-<first 8 hex of its id>`` (``run_dir_for``). A retry of
the flow run (``prefect flow-run retry``) keeps its id, so it finds its own checkpoints there and the
trainer resumes from the latest one; a new flow run starts a new directory. The task:

1. writes ``<run_dir>/config.yaml`` (the run config with ``output.dir`` = the run directory and the
   vocab map built upstream; storage options masked, torchrun reads a private temporary copy
   when there are any) and copies plan.json beside it;
2. on a retry, compares the plan recorded in the latest checkpoint with this plan and fails, naming
   each difference, before launching anything (the trainer checks the full contract again);
3. runs ``python -m torch.distributed.run ... -m specforge_core.train --config --plan`` through
   ``tasks.process_group`` (own session, streamed logs, progress + metrics artifacts, every process of
   the tree stopped on cancel or crash);
4. returns the newest checkpoint; cached per (flow run, plan) so a retry after a later stage failed
   shows train as Cached instead of launching torchrun for nothing.

Several nodes: ``deployment.nnodes > 1`` with ``deployment.rdzv_endpoint`` gives a c10d rendezvous
command, and ``SPECFORGE_LAUNCH_PREFIX`` (e.g. ``srun --nodes=4 --ntasks-per-node=1``) starts it once
per node; docs/deploy.md has the Slurm and JobSet recipes.
"""

import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml
from prefect import task
from prefect.logging import get_run_logger

from specforge_core.config import RunConfig, dump_config
from specforge_core.errors import ResumeError
from specforge_core.runtime.checkpoint import latest_checkpoint, read_train_state
from tasks.caching import StageOutput, content_key
from tasks.process_group import kill_recorded_tree, run_process_group

TREE_FILE = "train.tree"
LAUNCH_PREFIX_ENV = "SPECFORGE_LAUNCH_PREFIX"


def run_dir_for(output_dir: str, flow_run_name: str, flow_run_id: str) -> Path:
    """Where one flow run trains: stable across retries of that run, new for every new run."""
    return Path(output_dir) / f"{flow_run_name}-{str(flow_run_id).replace('-', '')[:8]}"


def torchrun_command(config: RunConfig, config_path: Path, plan_path: Path, rdzv_id: str) -> list[str]:
    """The worker command for this node: ``--standalone`` on one node, c10d rendezvous on several."""
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
    cmd += ["-m", "specforge_core.train", "--config", str(config_path), "--plan", str(plan_path)]
    prefix = shlex.split(os.environ.get(LAUNCH_PREFIX_ENV, ""))
    return prefix + cmd


def checkpoint_step(ckpt: Path) -> int:
    return int(read_train_state(ckpt)["step"])


def check_recorded_plan(ckpt: Path, plan_path: Path) -> None:
    """Fail before launching if the checkpoint this run would resume was trained under another plan."""
    recorded = (read_train_state(ckpt).get("contract") or {}).get("plan")
    if recorded is None:
        return
    current = json.loads(plan_path.read_text())
    keys = sorted((set(recorded) | set(current)) - {"derived", "permutation_sha256"})
    diffs = [f"{k}: checkpoint={recorded.get(k)!r} now={current.get(k)!r}" for k in keys
             if recorded.get(k) != current.get(k)]
    if diffs:
        raise ResumeError(
            "this flow run's checkpoint was trained under a different prompt plan:\n    " + "\n    ".join(diffs),
            where=str(ckpt),
            fix="a retry must keep the run's data and layout; restore them, or start a new flow run "
            "(prefect deployment run ...) which trains from scratch in a new directory",
        )


def trainer_config(config: RunConfig, run_dir: Path, vocab: StageOutput) -> RunConfig:
    """The run config as the trainer and the evaluator see it: this run's directory, this vocab map."""
    out = config.model_copy(deep=True)
    out.output.dir = str(run_dir)
    out.draft.vocab_map_path = vocab.path
    return out


@contextlib.contextmanager
def config_file(config: RunConfig, record: Path) -> Iterator[Path]:
    """Write ``record`` (credentials masked) and yield the file torchrun gets: ``record`` itself, or,
    with storage options set, a private temporary copy that holds them and is deleted afterwards
    (a run leaves no credentials in its outputs)."""
    record.write_text(yaml.safe_dump(dump_config(config), sort_keys=False))
    if not config.data.storage_options:
        yield record
        return
    fd, private = tempfile.mkstemp(prefix="specforge-train-", suffix=".yaml")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config.model_dump(mode="json"), f, sort_keys=False)
        yield Path(private)
    finally:
        os.unlink(private)


@task(name="train", cache_key_fn=content_key("train", location=lambda p: p["run_dir"]), persist_result=True)
def train(config: RunConfig, prompt_cache: StageOutput, vocab_map: StageOutput, plan: StageOutput,
          run_dir: str, key: str) -> StageOutput:
    """Train the draft under torchrun (resuming this flow run's latest checkpoint, if any)."""
    logger = get_run_logger()
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    plan_path = shutil.copyfile(plan.path, run / "plan.json")

    # A flow-run process killed by SIGKILL (OOM) leaves its torchrun tree running: the worker
    # reports the run Crashed, but nothing stopped the ranks, which still hold the run directory.
    stale = kill_recorded_tree(run / TREE_FILE)
    if stale:
        logger.warning("stopped %d training processes left running by an earlier attempt of this run", stale)

    resumed_from = None
    ckpt = latest_checkpoint(run)
    if ckpt is not None:
        check_recorded_plan(ckpt, Path(plan_path))
        resumed_from = checkpoint_step(ckpt)
        logger.info("resuming from %s (optimizer step %d of %d)", ckpt, resumed_from,
                    plan.facts["total_optimizer_steps"])

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.deployment.nproc_per_node)))}
    with config_file(trainer_config(config, run, vocab_map), run / "config.yaml") as config_path:
        outcome = run_process_group(
            torchrun_command(config, config_path, Path(plan_path), rdzv_id=key[:32]),
            env=env,
            log_path=run / "train.log",
            tree_path=run / TREE_FILE,
            metrics_path=run / "metrics.jsonl",
        )
    final = latest_checkpoint(run)
    if final is None:
        raise RuntimeError(f"training exited 0 but wrote no complete checkpoint under {run / 'checkpoints'}")
    facts = {"run_dir": str(run), "checkpoint": str(final), "step": checkpoint_step(final),
             "total_steps": plan.facts["total_optimizer_steps"], "resumed_from_step": resumed_from,
             "first_logged_step": outcome.first_step}
    logger.info("trained to optimizer step %d (%s)", facts["step"], final)
    return StageOutput(key=key, path=str(final), marker=str(final / "COMPLETE"), facts=facts)
