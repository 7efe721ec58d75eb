"""Safe defaults: weights load without pickle code execution, no remote model code unless the
config asks for it, Prefect bound to 127.0.0.1 in everything we ship, and storage credentials in
no log, cache file or saved config.

The source scans read the product code (specforge_core, tasks, flows, deployments, bench,
examples); tests may unpickle what they wrote themselves.
"""

import ast
import json
import re
from pathlib import Path

import fsspec
import pytest
import yaml

from specforge_core.capture.sglang_backend import SGLangEngineArgs
from specforge_core.config import RunConfig, config_from_dict, dump_config
from specforge_core.errors import ConfigError
from specforge_core.prepare import main as prepare_main
from specforge_core.run.topology import Topology
from tests.data.conftest import CHAT

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("specforge_core", "tasks", "flows", "deployments", "bench", "examples")
SHIPPED_TEXT = ("docs", "deployments", "examples", "flows", "tasks", "README.md", "Makefile")
SECRET = "sk-test-DO-NOT-LOG-7f3a9c"


def product_sources():
    for top in PRODUCT:
        yield from sorted((ROOT / top).rglob("*.py"))


def calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


def keyword(node: ast.Call, name: str):
    return next((k.value for k in node.keywords if k.arg == name), None)


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_the_scan_sees_the_product_code():
    names = {p.relative_to(ROOT).as_posix() for p in product_sources()}
    assert {"specforge_core/data/vocab.py", "specforge_core/config/__init__.py", "specforge_core/data/prompt_cache.py"} <= names


def test_every_torch_load_in_the_product_passes_weights_only_true():
    bad = []
    for path in product_sources():
        for node, owner, name in calls(ast.parse(path.read_text())):
            if name == "load" and owner == "torch":
                value = keyword(node, "weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    bad.append(where(path, node))
    assert bad == [], f"torch.load without weights_only=True (unpickles arbitrary code): {bad}"


def test_the_product_never_unpickles():
    bad = [where(p, n) for p in product_sources() for n, owner, name in calls(ast.parse(p.read_text()))
           if owner in ("pickle", "cPickle", "dill", "cloudpickle") and name in ("load", "loads")]
    assert bad == []


def test_no_code_turns_trust_remote_code_on_by_itself():
    bad = []
    for path in [*product_sources(), *sorted((ROOT / "tests").rglob("*.py"))]:
        for node, _, _ in calls(ast.parse(path.read_text())):
            value = keyword(node, "trust_remote_code")
            if isinstance(value, ast.Constant) and value.value is True:
                bad.append(where(path, node))
    assert bad == [], f"trust_remote_code=True written in code: {bad}"


def test_trust_remote_code_is_off_unless_the_config_sets_it():
    assert RunConfig().model.trust_remote_code is False
    cfg = RunConfig.model_validate({"model": {"target": "/m"}})
    assert SGLangEngineArgs.resolve(cfg, Topology.from_config(cfg)).kwargs()["trust_remote_code"] is False
    assert "--trust-remote-code" not in SGLangEngineArgs.resolve(cfg, Topology.from_config(cfg)).argv()
    on = RunConfig.model_validate({"model": {"target": "/m", "trust_remote_code": True}})
    assert SGLangEngineArgs.resolve(on, Topology.from_config(on)).kwargs()["trust_remote_code"] is True


def shipped_text_files():
    for name in SHIPPED_TEXT:
        p = ROOT / name
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
        yield from (f for f in files if f.suffix in ("", ".md", ".py", ".yaml", ".yml", ".sh", ".toml", ".txt"))


def test_shipped_prefect_servers_bind_to_localhost():
    bad = []
    for path in shipped_text_files():
        text = path.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            here = f"{path.relative_to(ROOT)}:{i}"
            if "0.0.0.0" in line:
                bad.append(f"{here}: binds every interface")
            if re.search(r"server[\"',\s]+start", line) and "prefect" in text.lower():
                host = re.search(r"--host[\"',\s=]+([\w.:]+)", line)
                if host and host.group(1) != "127.0.0.1":
                    bad.append(f"{here}: --host {host.group(1)}")
            m = re.search(r"PREFECT_SERVER_API_HOST\s*[=:]\s*[\"']?([\w.:]+)", line)
            if m and m.group(1) != "127.0.0.1":
                bad.append(f"{here}: PREFECT_SERVER_API_HOST={m.group(1)}")
    assert bad == [], "Prefect must stay on 127.0.0.1 (put a reverse proxy with auth in front otherwise): " + str(bad)


def test_the_deploy_doc_states_who_the_api_and_the_rendezvous_trust():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert "## Trust model" in doc
    trust = doc.split("## Trust model", 1)[1].split("\n## ", 1)[0]
    for needed in ("Prefect API", "job variables", "no authentication", "c10d", "rdzv_endpoint",
                   "only the cluster's nodes reach", "127.0.0.1"):
        assert needed in trust, f"docs/deploy.md's trust model no longer says {needed!r}"


# ---------------------------------------------------------------------------------------------
# Credentials


@pytest.fixture
def memory_data():
    """A data file on fsspec's in-memory filesystem, read with a secret storage option."""
    url = f"memory://reliability-{SECRET[-6:]}/chat.jsonl"
    with fsspec.open(url, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in CHAT))
    yield url
    fsspec.filesystem("memory").rm(url)


def secret_config(tmp_path, tiny_target_dir, train_files) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"target": str(tiny_target_dir)},
        "data": {"train_files": train_files, "cache_dir": str(tmp_path / "cache"),
                 "storage_options": {"token": SECRET, "client_kwargs": {"secret": SECRET}}},
        "draft": {"draft_vocab_size": 32},
    }))
    return path


def files_containing(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_storage_options_reach_no_output_log_or_cache_file(tmp_path, tiny_target_dir, memory_data, capsys, caplog):
    caplog.set_level("DEBUG")
    config = secret_config(tmp_path, tiny_target_dir, [memory_data])
    assert prepare_main(["--config", str(config)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["prompt_cache"]["rows"]["train"] == 3  # it did read through the options
    assert SECRET not in out.out + out.err + caplog.text
    assert files_containing(tmp_path / "cache", SECRET) == []


def test_storage_options_reach_no_error_message(tmp_path, tiny_target_dir, memory_data, capsys):
    missing = memory_data.replace("chat.jsonl", "missing.jsonl")
    config = secret_config(tmp_path, tiny_target_dir, [missing])
    assert prepare_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "file not found" in err and SECRET not in err


def test_a_saved_config_has_its_storage_options_redacted():
    cfg = RunConfig.model_validate({"data": {"storage_options": {"token": SECRET, "nested": {"key": SECRET}}}})
    saved = dump_config(cfg)
    assert SECRET not in json.dumps(saved) and set(saved["data"]["storage_options"]) == {"token", "nested"}


def test_a_rejected_storage_options_value_is_not_echoed():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"storage_options": f"token={SECRET}"}})
    assert "data.storage_options: Input should be a valid dictionary" in str(e.value) and SECRET not in str(e.value)


def test_a_training_run_writes_its_storage_options_nowhere(tmp_path, tiny_target_dir, capsys, caplog):
    from specforge_core.train import main as train_main

    caplog.set_level("DEBUG")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"target": str(tiny_target_dir), "dtype": "float32"},
        "data": {"train_files": [str(data)], "cache_dir": str(tmp_path / "cache"), "max_length": 64,
                 "storage_options": {"token": SECRET}},  # the local filesystem accepts and ignores it
        "draft": {"draft_vocab_size": 32},
        "training": {"max_steps": 1, "ttt_length": 2},
        "capture": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "out")},
    }))
    assert train_main(["--config", str(config)]) == 0
    out = capsys.readouterr()
    assert "step=1/1" in out.out
    assert SECRET not in out.out + out.err + caplog.text
    assert files_containing(tmp_path / "out", SECRET) == [] and files_containing(tmp_path / "cache", SECRET) == []
    assert any((tmp_path / "out").rglob("train_state.json"))  # the saved config is in there, redacted
