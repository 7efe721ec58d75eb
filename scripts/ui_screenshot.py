"""Screenshots of the Prefect UI for a real colocated-train run, taken with headless Chromium.

    python scripts/ui_screenshot.py                   # → docs/img/*.png (about 2 minutes on 2 cores)
    python scripts/ui_screenshot.py --out /tmp/shots

Starts a private Prefect server and process worker (flows/local_stack.py, temporary home,
telemetry off), deploys deployments/prefect.yaml, runs colocated-train/default on the tiny profile,
and photographs the flow-run page (run graph, task states, logs), two stage artifacts and the
deployment's run form (the run config rendered as a form), then stops everything. Needs Debian's `chromium` (`apt-get install -y chromium`).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.local_stack import PROJECT_DIR, LocalPrefect  # noqa: E402

def pages(api_url: str, flow_run_id: str) -> dict[str, tuple[str, str, int]]:
    """PNG name → (UI path, window size, ms of virtual time) for the run's page, two of its artifacts
    (V1 UI) and the deployment's run form (V2 UI: V1's form page was caught mid-fade)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter

    with SyncPrefectClient(api_url) as client:
        run = client.read_flow_run(flow_run_id)
        artifacts = {
            a.key: a.id for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(exists_=True)),
                flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        }
    shots = {"flow-run.png": (f"/runs/flow-run/{flow_run_id}", "1600,1000", 20000),
             "deployment-run-form.png": (f"/v2/deployments/deployment/{run.deployment_id}/run", "1600,1200", 20000)}
    for key in ("validation-report", "training-metrics"):
        if key in artifacts:
            shots[f"artifact-{key}.png"] = (f"/artifacts/artifact/{artifacts[key]}", "1600,1300", 20000)
    return shots


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("error: no Chromium found; install it with `apt-get install -y chromium` (Debian/Ubuntu)")


def screenshot(chromium: str, url: str, out: Path, profile_dir: Path, size: str = "1600,1000",
               budget_ms: int = 20000) -> None:
    """One PNG of ``url``; the UI is a single-page app, so give it virtual time to fetch and draw."""
    subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={profile_dir}", f"--window-size={size}", f"--virtual-time-budget={budget_ms}",
         f"--screenshot={out}", url],
        check=True, capture_output=True, timeout=120,
    )
    if not out.is_file() or out.stat().st_size < 10_000:
        raise RuntimeError(f"Chromium wrote no usable screenshot of {url} to {out}")


def run_tiny_deployment(stack: LocalPrefect) -> str:
    """Deploy and run colocated-train/default on the tiny profile; the flow-run id."""
    stack.prefect("work-pool", "create", "colocated-pool", "--type", "process")
    stack.deploy()
    stack.start_worker("colocated-pool")
    params = subprocess.run([sys.executable, "-m", "flows.demo", "--profile", "tiny", "--prepare-only"],
                            cwd=PROJECT_DIR, env=stack.env, check=True, capture_output=True, text=True).stdout
    done = stack.prefect("deployment", "run", "colocated-train/default", "--params", params.strip().splitlines()[-1],
                         "--watch", timeout_s=900)
    for line in done.stdout.splitlines():
        if "UUID:" in line:
            return line.split("UUID:")[1].strip()
    raise RuntimeError(f"no flow-run id in the output of prefect deployment run:\n{done.stdout}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/ui_screenshot.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(PROJECT_DIR / "docs" / "img"), help="folder for the PNG files")
    args = ap.parse_args(argv)
    chromium = find_chromium()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ui-shot-") as tmp:
        with LocalPrefect(Path(tmp) / "prefect-home") as stack:
            flow_run_id = run_tiny_deployment(stack)
            time.sleep(3)  # logs and artifacts reach the API in 2 s batches
            shots = pages(stack.api_url, flow_run_id)
            for name, (path, size, budget_ms) in shots.items():
                screenshot(chromium, stack.ui_url + path, out / name, Path(tmp) / "chromium", size, budget_ms)
                print(out / name)
    print(json.dumps({"flow_run_id": flow_run_id, "shots": sorted(shots)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
