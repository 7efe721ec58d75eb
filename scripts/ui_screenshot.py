"""Screenshots of the Prefect UI for a real colocated-train run, taken with headless Chromium.

    python scripts/ui_screenshot.py                   # → docs/img/*.png (about 2 minutes on 2 cores)
    python scripts/ui_screenshot.py --out /tmp/shots

Starts a private Prefect server and process worker (deployments/local_stack.py, temporary home,
telemetry off), deploys deployments/prefect.yaml, runs colocated-train/default on the tiny profile,
and photographs the flow-run page (V1 UI: run graph, task states, logs) and its Artifacts tab, then
stops everything. Needs Debian's `chromium` (`apt-get install -y chromium`).
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

from deployments.local_stack import PROJECT_DIR, LocalPrefect  # noqa: E402

SHOTS = {
    "flow-run.png": "/runs/flow-run/{id}",
    "flow-run-artifacts.png": "/runs/flow-run/{id}?tab=Artifacts",
}


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("error: no Chromium found; install it with `apt-get install -y chromium` (Debian/Ubuntu)")


def screenshot(chromium: str, url: str, out: Path, profile_dir: Path, size: str = "1600,1000") -> None:
    """One PNG of ``url``; the UI is a single-page app, so give it virtual time to fetch and draw."""
    subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={profile_dir}", f"--window-size={size}", "--virtual-time-budget=20000",
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
            for name, path in SHOTS.items():
                screenshot(chromium, stack.ui_url + path.format(id=flow_run_id), out / name, Path(tmp) / "chromium")
                print(out / name)
    print(json.dumps({"flow_run_id": flow_run_id, "shots": sorted(SHOTS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
