"""Recover a colocated-train flow run whose process died without telling the API.

    python -m flows.recover <flow-run-id>            # then:  prefect flow-run retry <flow-run-id>

A flow-run process killed by SIGKILL or the OOM killer with no one left to report it (its worker
died too, the node rebooted, or it ran without a worker) leaves its flow run in Running forever:
`prefect flow-run retry` refuses it, and `prefect flow-run cancel` only reaches Cancelled after
the server's 300 s cleanup timeout. This command, run on the machine that ran the
flow, from the directory the worker ran it in (the deployment's working directory):

1. refuses if the flow-run process recorded by the worker (``infrastructure_pid``) is still alive
   here (then it is not lost: cancel it instead), unless ``--force``;
2. stops the training processes the train task recorded in the run directory, if any survived
   (the SIGKILL that took the flow process gave it no chance to do so itself);
3. forces a run stuck in Running/Pending/Cancelling to Crashed, after which
   `prefect flow-run retry` resumes it from its latest checkpoint.

When only the flow-run process died and its worker lived, the worker already reported the run
Crashed; its leftover ranks are stopped by the retry's train task (or by this command, at once).
"""

import argparse
import asyncio
import socket
import sys

import psutil
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.states import Crashed

from tasks.process_group import kill_recorded_tree
from specforge_core.run.directory import RunDir
from tasks.train_stage import run_dir_for

STUCK = {StateType.RUNNING, StateType.PENDING, StateType.CANCELLING}


def _flow_process_alive(infrastructure_pid: str | None) -> int | None:
    """The pid of the worker-recorded flow-run process if it is alive on this host, else None."""
    if not infrastructure_pid or ":" not in infrastructure_pid:
        return None
    host, _, pid = infrastructure_pid.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        proc = psutil.Process(int(pid))
        return proc.pid if proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def _stop_leftover_training(run) -> None:
    config = (run.parameters or {}).get("config")
    if not isinstance(config, dict):
        return
    output_dir = (config.get("output") or {}).get("dir", "runs/default")
    record = RunDir(run_dir_for(output_dir, run.name, str(run.id))).process_tree
    stopped = kill_recorded_tree(record)
    if stopped:
        print(f"stopped {stopped} leftover training process(es) recorded in {record}")
    record.unlink(missing_ok=True)


async def recover(flow_run_id: str, *, force: bool = False) -> int:
    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        state = run.state.type if run.state else None
        pid = _flow_process_alive(run.infrastructure_pid)
        if pid and not force:
            print(f"error: the flow-run process {pid} is still alive on this host, so the run is not lost; "
                  f"cancel it with `prefect flow-run cancel {run.id}` (or pass --force)", file=sys.stderr)
            return 2
        _stop_leftover_training(run)
        if state not in STUCK:
            print(f"flow run {run.name} ({run.id}) is {run.state.name if run.state else 'without state'}, "
                  f"not stuck; `prefect flow-run retry {run.id}` retries it if it failed or crashed")
            return 0
        await client.set_flow_run_state(
            run.id, Crashed(message="flow-run process lost (recovered by flows.recover)"), force=True
        )
        print(f"flow run {run.name} ({run.id}) marked Crashed; resume it with:\n"
              f"    prefect flow-run retry {run.id}")
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.recover", description=__doc__.splitlines()[0])
    ap.add_argument("flow_run_id", help="the id of the flow run stuck in Running")
    ap.add_argument("--force", action="store_true", help="even if its flow-run process is alive here")
    args = ap.parse_args(argv)
    return asyncio.run(recover(args.flow_run_id, force=args.force))


if __name__ == "__main__":
    sys.exit(main())
