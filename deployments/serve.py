"""The serve alternative to prefect.yaml + worker: one long-running process that runs the deployments.

    python -m deployments.serve                # from the project root; Ctrl-C (or SIGTERM) stops it

Registers every deployment of deployments/prefect.yaml (colocated-train/default, colocated-train/nightly
with its cron 03:00 UTC and concurrency 1, and one per GPU recipe) with its parameters, then polls
for their runs and executes each in a child process on this machine (serve has no work pools: run
it on the GPU node to serve the GPU recipes). Differences from the worker path (Prefect 3.9): no work pool is needed; code edits
need a restart (serve runs the flow object it imported); on shutdown the deployments are paused;
on cancel serve SIGTERMs only the flow-run process, so the train task's own process-group kill is
what stops torchrun's ranks.
"""

from pathlib import Path

import yaml
from prefect import serve

from flows.colocated_train import colocated_train

PREFECT_YAML = Path(__file__).with_name("prefect.yaml")


def deployments_from_yaml(path: Path = PREFECT_YAML) -> list:
    """The deployments of prefect.yaml as ``RunnerDeployment`` objects (same names, parameters,
    schedules and concurrency limits)."""
    spec = yaml.safe_load(path.read_text())
    out = []
    for d in spec["deployments"]:
        crons = [s["cron"] for s in d.get("schedules", []) if s.get("active", True)]
        out.append(colocated_train.to_deployment(
            name=d["name"],
            description=d.get("description"),
            parameters=d["parameters"],
            cron=crons[0] if crons else None,
            concurrency_limit=d.get("concurrency_limit"),
        ))
    return out


if __name__ == "__main__":
    serve(*deployments_from_yaml())
