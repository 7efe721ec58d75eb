"""SGLang lives behind one pinned module; nothing else in the project imports it."""

import ast
import sys
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


def test_missing_sglang_is_refused_naming_the_extra_and_the_pinned_version():
    # this CPU environment has no sglang installed (the contract test reads its wheel instead)
    with pytest.raises(CaptureError, match=rf"\[sglang\]' \(sglang=={sglang_engine.SGLANG_VERSION}\)") as e:
        sglang_engine.require_sglang()
    assert "not installed" in str(e.value) and "capture.backend=hf" in str(e.value)


def test_another_sglang_version_is_refused_without_importing_it(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.23" if name == "sglang" else real(name))
    with pytest.raises(CaptureError, match=f"sglang 0.5.23 is installed.*{sglang_engine.SGLANG_VERSION}"):
        sglang_engine.require_sglang()
    assert "sglang" not in sys.modules
