"""The package's floors: each imports only the floors below it, as docs/architecture.md's table says.

Every ``import`` of project code (top-level and inside functions) is read with ``ast``; an import
that runs back up a floor, or across to another folder of the same floor, fails here until the
table (and this test's copy of it) says why.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("train", "prepare", "export", "evaluate", "regenerate", "cli")

# Lowest first. A folder imports itself and the floors below its own; folders of one floor import
# none of each other. "cmd" is the commands (python -m specforge_core.<name>, every __main__.py).
FLOORS = [
    ("errors", "io"),  # errors and atomic files: nothing of the project
    ("system",),  # torch-level helpers: device, process group, host settings, compilation
    ("run",),  # the run's records: topology, plan, manifest, run directory, metrics file
    ("config", "data"),  # the run config; conversations, prompt cache, vocab map
    ("capture",),  # the target and its capture backends
    ("loop",),  # the family-agnostic training loop
    ("drafts",),  # the family registry and the families
    ("decoding",),  # speculative decoding with the HF target, the evaluator
    ("launch",),  # a rank's launch: build, preflight, dry run, held-out decodes
    ("cmd",),
    ("fixtures",),  # test and demo fixtures
    ("tasks",),
    ("flows",),
    ("deployments",),
]
LEVEL = {part: level for level, parts in enumerate(FLOORS) for part in parts}
PROJECT = ("specforge_core", "tasks", "flows", "deployments", "fixtures")
FAMILIES = ("eagle3", "dflash", "dspark")
# a family built on another imports that one (its base) and no other
BASES = {"dspark": {"dflash"}}


def floor(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "specforge_core":
        return parts[0]
    if len(parts) == 1 or parts[1] in COMMANDS or parts[-1] == "__main__":
        return "cmd"
    return parts[1]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(tops=PROJECT + ("prefect",)) -> list[tuple[str, str, str]]:
    """(source module, imported module, file:line) for every import of ``tops``' modules."""
    out = []
    for top in PROJECT:
        for path in sorted((ROOT / top).rglob("*.py")):
            source = module_of(path)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    if name.split(".")[0] in tops:
                        out.append((source, name, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return out


def test_every_part_of_the_house_stands_on_a_floor():
    seen = {floor(source) for source, _, _ in imports()}
    assert seen <= set(LEVEL), f"folders on no floor: {sorted(seen - set(LEVEL))}"
    assert set(LEVEL) - {"errors", "io"} <= seen


def test_no_import_runs_back_up_or_across_a_floor():
    bad = [f"{where}: {floor(s)} → {floor(t)} ({t})" for s, t, where in imports(PROJECT)
           if floor(s) != floor(t) and LEVEL[floor(t)] >= LEVEL[floor(s)]]
    assert bad == [], "imports that run back up (docs/architecture.md, folders):\n" + "\n".join(bad)


def test_the_scan_knows_every_registered_family():
    from specforge_core.drafts import FAMILIES as REGISTERED

    assert set(REGISTERED) == set(FAMILIES)


def test_a_draft_family_imports_no_other_family_but_its_base():
    def family(module):
        parts = module.split(".")
        return parts[2] if parts[:2] == ["specforge_core", "drafts"] and len(parts) > 2 and parts[2] in FAMILIES else None

    bad = [where for s, t, where in imports(PROJECT) if family(s) and family(t) and family(s) != family(t)
           and family(t) not in BASES.get(family(s), ())]
    assert bad == []


def test_the_library_never_imports_prefect_the_product_or_the_fixtures():
    bad = [where for s, t, where in imports() if s.startswith("specforge_core")
           and t.split(".")[0] in ("prefect", "tasks", "flows", "deployments", "fixtures")]
    assert bad == []
