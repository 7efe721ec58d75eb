"""Load a script of ``bench/`` as a module, so tests can call its functions."""

import importlib.util
import os
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """``bench/<name>.py`` as a fresh module; the environment variables its import sets (OpenMP
    threads, the CUDA allocator) are put back afterwards."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module
