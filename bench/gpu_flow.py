"""The flow as a user starts it, then crashed and retried: a real Prefect server, work pool, worker and deployment.

    python bench/gpu_flow.py --config C.yaml [overrides ...] --out DIR          # GPU node, Prefect installed
    python bench/gpu_flow.py --config examples/gpu/smollm2-135m-1gpu.yaml --deployment smollm2-135m-1gpu \
        model.target=T data.train_files=[F] training.max_steps=60 training.save_interval=20 --out DIR
    python bench/gpu_flow.py --config examples/tiny-cpu.yaml model.target=T data.train_files=[F] \
        training.max_steps=20 training.save_interval=2 --out DIR                  # the same on a CPU

One call, everything under ``--out`` (the Prefect home, its SQLite database and logs, the runs):

1. ``prefect server start`` on 127.0.0.1, the work pools ``colocated-pool`` and ``gpu-pool`` (process
   type), ``prefect deploy --all`` of ``deployments/prefect.yaml`` and one worker on the pool of the
   deployment ``--deployment`` names (``flows/local_stack.py``);
2. ``prefect deployment run colocated-train/<deployment> --params {"config": C} --watch``: the data
   stages, training and validation must end Completed;
3. the same deployment again without ``--watch``; once its first checkpoint is on disk the training
   task's torchrun and ranks are killed with SIGKILL (the process tree the train task records),
   the flow run must end Crashed or Failed, ``prefect flow-run retry`` starts it again, and it must
   resume from that checkpoint (the rank's ``resumed from`` line) and end Completed.

Each run's stages with their states and seconds (task runs, from the API), wall times and the
resumed checkpoint go to ``DIR/flow.json`` and a ``RESULT {json}`` line; exit status 1 when a run
did not end as it must. The config is the flow's parameter, as a user would pass it; the second
run writes its own run directory (each flow run has one).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.local_stack import wait_for  # noqa: E402  (after the project root is on the path)

FLOW = "colocated-train"
ENDED = {"Completed", "Failed", "Crashed", "Cancelled"}  # a flow run's final states


def deployment_pool(name: str) -> str:
    """The work pool ``deployments/prefect.yaml`` gives the deployment ``name``."""
    import yaml

    from flows.local_stack import PREFECT_YAML

    spec = yaml.safe_load(PREFECT_YAML.read_text())
    pools = {d["name"]: d["work_pool"]["name"] for d in spec["deployments"]}
    if name not in pools:
        raise SystemExit(f"--deployment {name}: no such deployment in {PREFECT_YAML.name} "
                         f"(it has {', '.join(sorted(pools))})")
    return pools[name]


def start_run(stack, deployment: str, config: dict, *, watch: bool, timeout_s: float) -> tuple[str, float]:
    """A flow run of ``deployment`` with ``config``: its id and the seconds the CLI took."""
    t = time.monotonic()
    done = stack.prefect("deployment", "run", f"{FLOW}/{deployment}", "--params", json.dumps({"config": config}),
                         *(["--watch"] if watch else []), timeout_s=timeout_s, check=False)
    ids = [line.split("UUID:")[1].strip() for line in done.stdout.splitlines() if "UUID:" in line]
    if not ids:
        raise RuntimeError(f"no flow run was created:\n{done.stdout}\n{done.stderr}")
    return ids[0], time.monotonic() - t


def stages(client, flow_run_id: str) -> dict[str, list[dict]]:
    """Stage name → its task runs, oldest first: state and seconds (a retried run has two of some)."""
    from prefect.client.schemas.filters import FlowRunFilter

    out: dict[str, list[dict]] = {}
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    for r in sorted(runs, key=lambda r: r.expected_start_time):
        seconds = r.total_run_time.total_seconds() if r.total_run_time else None
        out.setdefault(r.name.rsplit("-", 1)[0], []).append({"state": r.state.name, "seconds": seconds})
    return out


def final_state(client, flow_run_id: str, names: set[str], timeout: float) -> str:
    """The flow run's state name once it is one of ``names`` (TimeoutError after ``timeout`` s)."""
    return wait_for(lambda: (s := client.read_flow_run(flow_run_id).state.name) in names and s, timeout,
                    f"flow run {flow_run_id} in {sorted(names)}", interval=0.5)


def kill_training(run_dir: Path, timeout: float) -> tuple[str, list[int]]:
    """SIGKILL the train task's torchrun and ranks once the run has a checkpoint: (checkpoint, pids)."""
    from specforge_core.loop.checkpoint import latest_checkpoint
    from specforge_core.run.directory import RunDir
    from tasks.process_group import tree_members

    checkpoint = wait_for(lambda: latest_checkpoint(run_dir), timeout, f"a checkpoint under {run_dir}", 0.2)
    tree = RunDir(run_dir).process_tree
    if not tree.is_file():  # the train task removes it when training ends
        raise RuntimeError(f"the run ended before it could be killed ({checkpoint.name}): raise training.max_steps")
    record = json.loads(tree.read_text())
    pids = [p.pid for p in tree_members(record["token"])]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return checkpoint.name, pids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the run config (a recipe), passed as the flow's parameter")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=20")
    ap.add_argument("--out", required=True, help="Prefect home, runs and flow.json")
    ap.add_argument("--deployment", default="default",
                    help="the deployment of deployments/prefect.yaml to run (its worker serves that pool)")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds one flow run may take")
    args = ap.parse_args(argv)
    pool = deployment_pool(args.deployment)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    # a SIGTERM (a timeout's) unwinds like an error: the server, the worker and the ranks are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from specforge_core.config import load_config

    loaded = load_config(args.config, args.overrides)
    t = loaded.training
    if not (t.save_interval and t.max_steps and t.save_interval < t.max_steps):
        ap.error("the killed run needs a checkpoint before its end: set training.max_steps and a smaller "
                 "training.save_interval (e.g. training.max_steps=60 training.save_interval=20)")
    config = loaded.model_dump(mode="json")
    config["output"]["dir"] = str(out / "runs")
    result: dict = {"config": args.config, "overrides": args.overrides, "deployment": f"{FLOW}/{args.deployment}",
                    "work_pool": pool}
    t0 = time.monotonic()
    try:
        return run_both(args, pool, out, config, result, t0)
    finally:  # torchrun and its ranks run in sessions of their own: the worker's stop does not reach them
        from tasks.process_group import stop_process_tree

        for record in (out / "runs").glob("*/train.tree"):
            try:
                stop_process_tree(json.loads(record.read_text())["token"], grace_s=5)
            except (OSError, ValueError, KeyError):
                pass


def run_both(args, pool: str, out: Path, config: dict, result: dict, t0: float) -> int:
    """The watched run and the killed-and-retried one (module doc); writes flow.json, returns the exit status."""
    from prefect.client.orchestration import SyncPrefectClient

    from flows.local_stack import LocalPrefect
    from specforge_core.run.directory import RunDir
    from tasks.train_stage import run_dir_for

    with LocalPrefect(out / "prefect-home") as stack:
        stack.prefect("work-pool", "create", "colocated-pool", "--type", "process", "--overwrite")
        stack.prefect("work-pool", "create", "gpu-pool", "--type", "process", "--overwrite")  # the GPU recipes' pool
        stack.deploy()
        stack.start_worker(pool)
        result["stack_seconds"] = round(time.monotonic() - t0, 1)
        with SyncPrefectClient(stack.api_url) as client:
            # 1. a run as a user starts it, watched to its end
            first, seconds = start_run(stack, args.deployment, config, watch=True, timeout_s=args.run_timeout)
            state = final_state(client, first, ENDED, 60)
            result["watched"] = {"flow_run": first, "state": state, "seconds": round(seconds, 1),
                                 "stages": stages(client, first)}
            # 2. a run killed after its first checkpoint, then retried
            second, _ = start_run(stack, args.deployment, config, watch=False, timeout_s=120)
            run = wait_for(lambda: client.read_flow_run(second), 60, "the second flow run")
            run_dir = run_dir_for(config["output"]["dir"], run.name, str(run.id))
            checkpoint, pids = kill_training(run_dir, args.run_timeout)
            crashed = final_state(client, second, ENDED, 300)
            t = time.monotonic()
            stack.prefect("flow-run", "retry", second, timeout_s=60)
            retried = final_state(client, second, ENDED, args.run_timeout)
            log = RunDir(run_dir).train_log
            resumed = [line.strip() for line in (log.read_text(errors="replace").splitlines() if log.is_file() else [])
                       if line.lstrip().startswith("resumed from")]
            result["killed_and_retried"] = {
                "flow_run": second, "killed_after": checkpoint, "killed_pids": len(pids), "state_after_kill": crashed,
                "state_after_retry": retried, "retry_seconds": round(time.monotonic() - t, 1),
                "resume_lines": resumed[-3:], "stages": stages(client, second)}
    result["seconds"] = round(time.monotonic() - t0, 1)
    killed = result["killed_and_retried"]
    ok = (result["watched"]["state"] == "Completed" and killed["state_after_kill"] != "Completed"
          and killed["state_after_retry"] == "Completed" and bool(killed["resume_lines"]))
    result["ok"] = ok
    (out / "flow.json").write_text(json.dumps(result, indent=1))
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
