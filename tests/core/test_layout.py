"""The package's floors: each imports only the floors docs/architecture.md's table allows.

Every ``import`` of project code (top-level and inside functions) is read with ``ast``; a new
dependency between floors fails here until the table (and this test's copy of it) says why.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("train", "prepare", "export", "evaluate", "regenerate", "cli")
ANY_LIBRARY = {"cmd", "config", "errors", "io", "run", "data", "capture", "drafts", "drafts/eagle3",
               "drafts/dflash", "runtime", "decoding"}

# floor -> floors it may import (besides itself); "floor:module" allows one module of a floor only
ALLOWED = {
    "cmd": ANY_LIBRARY,
    "config": {"errors", "cmd", "run:specforge_core.run.topology"},
    "errors": set(),
    "io": set(),
    "run": {"errors", "io", "config"},
    "data": {"errors", "io"},
    "capture": {"errors", "run:specforge_core.run.topology", "runtime:specforge_core.runtime.device",
                "runtime:specforge_core.runtime.compile"},
    "drafts": {"errors", "runtime:specforge_core.runtime.checkpoint"},
    "drafts/eagle3": {"errors", "io", "drafts", "capture:specforge_core.capture.target_info",
                      "runtime:specforge_core.runtime.checkpoint", "runtime:specforge_core.runtime.compile"},
    "drafts/dflash": {"errors", "io", "drafts", "capture:specforge_core.capture.target_info",
                      "runtime:specforge_core.runtime.checkpoint"},
    "runtime": {"errors", "io", "config", "run", "data", "capture", "drafts"},
    "decoding": {"errors", "io", "run", "data", "drafts", "runtime:specforge_core.runtime.device",
                 "runtime:specforge_core.runtime.checkpoint"},
    "tasks": {"prefect"} | ANY_LIBRARY,
    "flows": {"prefect", "tasks", "fixtures"} | ANY_LIBRARY,
    "deployments": {"prefect", "flows", "tasks"},
    "fixtures": {"errors", "capture"},
}
# one module may reach one floor further than its floor's row, for the reason given
MODULE_EXCEPTIONS = {
    # the held-out decode during training runs the evaluator's own decoding (docs/validation-sharegpt.md)
    "specforge_core.runtime.heldout": {"decoding"},
}
PROJECT = ("specforge_core", "tasks", "flows", "deployments", "fixtures", "prefect")


def floor(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "specforge_core":
        return parts[0]
    if len(parts) == 1:
        return "cmd"
    if parts[1] in COMMANDS:
        return "cmd"
    if parts[1] == "drafts" and len(parts) > 2 and parts[2] in ("eagle3", "dflash"):
        return f"drafts/{parts[2]}"
    return parts[1]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] in ("__init__", "__main__"):
        parts = parts[:-1]
    return ".".join(parts)


def imports() -> list[tuple[str, str, str]]:
    """(source module, imported module, file:line) for every import of project code."""
    out = []
    for top in ("specforge_core", "tasks", "flows", "deployments", "fixtures"):
        for path in sorted((ROOT / top).rglob("*.py")):
            source = module_of(path)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    if name.split(".")[0] in PROJECT:
                        out.append((source, name, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return out


def allowed(source: str, target: str) -> bool:
    src, dst = floor(source), floor(target)
    if src == dst or dst in ALLOWED[src] or dst in MODULE_EXCEPTIONS.get(source, ()):
        return True
    return any(rule == f"{dst}:{target}" or (rule.startswith(f"{dst}:") and target.startswith(rule.split(":")[1]))
               for rule in ALLOWED[src])


def test_the_scan_sees_every_floor():
    seen = {floor(source) for source, _, _ in imports()}
    assert set(ALLOWED) - {"errors", "io"} <= seen


def test_every_import_between_floors_is_one_the_architecture_allows():
    bad = [f"{where}: {floor(s)} → {t}" for s, t, where in imports() if not allowed(s, t)]
    assert bad == [], "imports across floors that docs/architecture.md does not allow:\n" + "\n".join(bad)


def test_the_library_never_imports_prefect_the_product_or_the_fixtures():
    bad = [where for s, t, where in imports() if s.startswith("specforge_core")
           and t.split(".")[0] in ("prefect", "tasks", "flows", "deployments", "fixtures")]
    assert bad == []
