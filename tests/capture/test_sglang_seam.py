"""SGLang lives behind one pinned module; nothing else in the project imports it."""

import ast
import sys
import types
from pathlib import Path

import pytest

from specforge_core.capture import sglang_engine
from specforge_core.errors import CaptureError

ROOT = Path(__file__).resolve().parents[2]
SEAM = ROOT / "specforge_core" / "capture" / "sglang_engine.py"


def sglang_imports(path: Path) -> list[int]:
    """Line numbers of `import sglang...`, `from sglang... import`, or import_module("sglang...")."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "sglang" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__",
        ) and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("sglang"):
            lines.append(node.lineno)
    return lines


def test_sglang_is_imported_only_in_the_seam_module():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("specforge_core", "tasks", "flows", "deployments")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != SEAM
        for line in sglang_imports(path)
    ]
    assert offenders == []
    assert sglang_imports(SEAM), "the seam itself should hold the sglang imports"


def test_the_seam_pins_one_sglang_version():
    assert sglang_engine.SGLANG_VERSION.count(".") == 2


def test_missing_sglang_is_reported_with_the_pinned_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(CaptureError, match=f"pip install sglang=={sglang_engine.SGLANG_VERSION}"):
        sglang_engine.require_sglang()


def test_another_sglang_version_is_refused(monkeypatch):
    other = types.ModuleType("sglang")
    other.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "sglang", other)
    with pytest.raises(CaptureError, match=f"sglang 0.4.0 is installed.*{sglang_engine.SGLANG_VERSION}"):
        sglang_engine.require_sglang()
