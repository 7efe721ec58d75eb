"""The bad-input corpus: every case is refused with the problem and the fix, exit code ≠ 0, and
nothing written.

    PYTHONPATH=. python -m pytest tests/bad_inputs -q                 # all cases
    PYTHONPATH=. python -m pytest tests/bad_inputs -q -k sglang       # some of them

One YAML file per case under ``cases/<group>/`` (group: data, config, model). A case says:

``about``     one line: what is wrong.
``command``   the CLI that must refuse it: ``prepare`` (python -m specforge_core.prepare),
              ``config`` (python -m specforge_core.config) or ``train`` (python -m
              specforge_core.train, one rank).
``files``     files written into the case directory first; a value is text, or
              ``{text, encoding}`` for bytes in another encoding. ``data.jsonl`` defaults to three
              good conversations.
``config``    merged over ``base.yaml`` (tiny target, data.jsonl, caches and output in the case
              directory) and written to ``run.yaml``; or ``config_text``: run.yaml verbatim.
``args``      extra CLI arguments (dotted overrides); ``argv`` replaces the whole argument list.
``models``    target directories made for the case: ``{name: {config: {...}, remove: [file]}}``
              copies the tiny target, patches its config.json and removes files.
``vocab_maps`` vocab map files made for the case: ``{name: [V, Vd]}``.
``draft_configs`` draft config files made for the case: ``{name: {field: value}}`` patches the
              draft config generated for the tiny target (Vd = 32).
``expect``    ``problem`` and ``fix``: lists of substrings the error message must contain.
``process``   true: run as a real ``python -m`` process (the exit code the shell sees), else
              in-process through the module's ``main(argv)``, which is what ``python -m`` returns.
``xfail``     a known gap, with the reason: the case is expected to fail (strictly: once the gap
              is closed the case passes, the run reports it, and the line must be removed).

``${case}``, ``${tiny_target}`` and ``${<model name>}`` in any string are replaced by paths.
"Nothing written" means: after the refusal the case directory holds exactly the files and
directories it held before (no lock file, no remembered digest, no empty directory), and the
output directory does not exist.
"""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import specforge_core.config.__main__
import specforge_core.prepare
import specforge_core.train

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CASES = sorted((HERE / "cases").glob("*/*.yaml"))
COMMANDS = {"prepare": specforge_core.prepare, "config": specforge_core.config.__main__, "train": specforge_core.train}
GOOD_ROWS = [
    {"conversations": [{"role": "user", "content": "Hello, what is the capital of France?"},
                       {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"conversations": [{"role": "system", "content": "Answer in one line."},
                       {"role": "user", "content": "Name two colors."},
                       {"role": "assistant", "content": "Red and blue."}]},
    {"conversations": [{"role": "user", "content": "Count to three."},
                       {"role": "assistant", "content": "One, two, three."}]},
]


def load_case(path: Path) -> dict:
    case = yaml.safe_load(path.read_text())
    unknown = set(case) - {"about", "command", "files", "config", "config_text", "args", "argv", "models",
                           "vocab_maps", "draft_configs", "expect", "process", "xfail"}
    assert not unknown, f"{path.name}: unknown case keys {sorted(unknown)}"
    assert case["command"] in COMMANDS and case["expect"]["problem"] and case["expect"]["fix"], path.name
    return case


def substitute(value, paths: dict[str, str]):
    """``${name}`` → path, in every string of a nested value."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)\}", lambda m: paths[m.group(1)], value)
    if isinstance(value, list):
        return [substitute(v, paths) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, paths) for k, v in value.items()}
    return value


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_models(case: dict, root: Path, tiny_target: Path) -> dict[str, str]:
    paths = {}
    for name, spec in (case.get("models") or {}).items():
        out = root / "models" / name
        shutil.copytree(tiny_target, out)
        if spec.get("config"):
            cfg = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**cfg, **spec["config"]}))
        for f in spec.get("remove", []):
            (out / f).unlink()
        paths[name] = str(out)
    return paths


def make_vocab_maps(case: dict, root: Path) -> None:
    import numpy as np
    import torch

    from specforge_core.data.vocab import select_draft_vocab

    for name, (V, Vd) in (case.get("vocab_maps") or {}).items():
        d2t, t2d = select_draft_vocab(np.zeros(V, dtype=np.int64), Vd)
        torch.save({"d2t": d2t, "t2d": t2d}, root / name)


def make_draft_configs(case: dict, root: Path, tiny_target: Path) -> None:
    from transformers import AutoConfig

    from specforge_core.drafts.eagle3.draft_config import draft_config_from_target, serving_config_dict

    for name, patch in (case.get("draft_configs") or {}).items():
        generated = serving_config_dict(draft_config_from_target(AutoConfig.from_pretrained(tiny_target), 32))
        (root / name).write_text(json.dumps({**generated, **patch}))


def write_files(case: dict, root: Path, paths: dict) -> None:
    files = {"data.jsonl": "".join(json.dumps(r) + "\n" for r in GOOD_ROWS), **(case.get("files") or {})}
    for name, spec in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(spec, dict):
            path.write_bytes(substitute(spec["text"], paths).encode(spec["encoding"]))
        else:
            path.write_text(substitute(spec, paths), encoding="utf-8")


def snapshot(root: Path) -> set[str]:
    """Every file and directory under ``root`` (a directory with a trailing /)."""
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*")}


def run(case: dict, argv: list[str], root: Path, capsys) -> tuple[int, str]:
    if case.get("process"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-m", f"specforge_core.{case['command']}", *argv],
                              capture_output=True, text=True, cwd=root, env=env, timeout=120)
        return proc.returncode, proc.stderr
    code = COMMANDS[case["command"]].main(argv)
    return code, capsys.readouterr().err


def case_param(path: Path):
    reason = yaml.safe_load(path.read_text()).get("xfail")
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(path, marks=marks, id=f"{path.parent.name}/{path.stem}")


@pytest.mark.parametrize("path", [case_param(p) for p in CASES])
def test_bad_input_is_refused_naming_problem_and_fix_and_writes_nothing(path, tmp_path, tiny_target_dir,
                                                                        monkeypatch, capsys):
    case = load_case(path)
    root = tmp_path / "case"
    root.mkdir()
    monkeypatch.chdir(root)  # a relative path the command might write to lands in the case dir
    paths = {"case": str(root), "tiny_target": str(tiny_target_dir)}
    paths.update(make_models(case, root, tiny_target_dir))
    make_vocab_maps(case, root)
    make_draft_configs(case, root, tiny_target_dir)
    write_files(case, root, paths)
    run_yaml = root / "run.yaml"
    if "config_text" in case:
        run_yaml.write_text(case["config_text"])
    else:
        base = yaml.safe_load((HERE / "base.yaml").read_text())
        run_yaml.write_text(yaml.safe_dump(substitute(merged(base, case.get("config") or {}), paths)))
    argv = substitute(case.get("argv") or ["--config", str(run_yaml), *(case.get("args") or [])], paths)
    before = snapshot(root)

    code, err = run(case, argv, root, capsys)

    assert code != 0, f"{path.name}: accepted (exit 0)"
    assert "Traceback" not in err, f"{path.name}: crashed instead of refusing:\n{err}"
    assert "fix:" in err, f"{path.name}: no fix in:\n{err}"
    for part in ("problem", "fix"):
        for needle in substitute(case["expect"][part], paths):
            assert needle in err, f"{path.name}: {part} {needle!r} not in:\n{err}"
    written = sorted(snapshot(root) - before)
    assert written == [], f"{path.name}: a refused run left {written}"
    assert not (root / "out").exists()


def test_corpus_covers_data_config_and_model_inputs():
    groups = [p.parent.name for p in CASES]
    assert len(CASES) >= 30 and {"data", "config", "model"} <= set(groups)
    assert all(load_case(p) for p in CASES)


@pytest.mark.parametrize("command", ["prepare", "train"])
def test_a_bad_line_found_mid_build_is_refused_and_leaves_nothing(command, tmp_path, tiny_target_dir, monkeypatch,
                                                                 capsys):
    from specforge_core.data.prompt_cache import _CHUNK_ROWS

    root = tmp_path / "case"
    root.mkdir()
    monkeypatch.chdir(root)
    good = 3 * _CHUNK_ROWS  # whole chunks written into the build's directory before the bad line is read
    (root / "data.jsonl").write_text("".join(json.dumps(GOOD_ROWS[i % 3]) + "\n" for i in range(good))
                                     + '{"conversations": [\n')
    base = yaml.safe_load((HERE / "base.yaml").read_text())
    (root / "run.yaml").write_text(yaml.safe_dump(substitute(base, {"case": str(root), "tiny_target": str(tiny_target_dir)})))
    before = snapshot(root)

    code, err = run({"command": command}, ["--config", str(root / "run.yaml")], root, capsys)

    assert code != 0 and f"data.jsonl:{good + 1}" in err and "Traceback" not in err, err
    assert sorted(snapshot(root) - before) == []
    assert not (root / "out").exists()
