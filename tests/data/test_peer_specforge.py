"""The peer: bench/peer_specforge.py (SpecForge 0.2.0's EAGLE3 trainer on the real check's answers)
and its row in bench/gpu_quality.py, beside our EAGLE3 row of the same run.

The tests that run SpecForge import it from an installed ``specforge==0.2.0`` or from the wheel
``make install`` fetches into ``.cache/wheels`` (``fixtures/wheels.py``), and skips without either.
On the CPU the peer's Triton loss runs under Triton's interpreter (TRITON_INTERPRET=1: tests/conftest.py
sets it for this process, bench/gpu_quality.py for the peer's row on a CPU).
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from scripts.sharegpt_realcheck import ROOT, main as realcheck
from specforge_core.config import config_from_dict
from specforge_core.errors import ConfigError
from tests.bench_scripts import load_bench
from tests.data.test_sharegpt_realcheck import tiny_base

quality = load_bench("gpu_quality")
peer = load_bench("peer_specforge")
NO_SPECFORGE = ("specforge==0.2.0 is neither installed nor in .cache/wheels: run make install "
                "(python -m fixtures.wheels fetches the wheel)")
COUNTS = ["--answers", "4", "--answer-tokens", "8", "--validation-prompts", "2", "--heldout-prompts", "2"]


def specforge_on_path() -> str | None:
    """What PYTHONPATH needs for ``import specforge`` at 0.2.0: the wheel file ``make install``
    fetched (a pure-Python wheel imports as a zip), else "" when it is installed; None without either."""
    from fixtures.wheels import wheel_path

    try:
        return str(wheel_path("specforge", "0.2.0"))
    except FileNotFoundError:
        pass
    try:
        return "" if importlib.metadata.version("specforge") == "0.2.0" else None
    except importlib.metadata.PackageNotFoundError:
        return None


SPECFORGE_PATH = specforge_on_path()


def row(tau, samples_per_second, **benchmarks):
    return {"heldout_acceptance_length": tau, "samples_per_second": samples_per_second, "benchmarks": benchmarks}


def test_ours_over_peer_divides_our_eagle3_row_by_the_peers_and_checks_both_targets():
    ratios = quality.ours_over_peer(row(2.4, 30.0, **{"mt-bench": 2.2}), row(2.0, 20.0, **{"mt-bench": 2.0}))
    assert ratios["heldout_acceptance_length"] == 1.2 and ratios["samples_per_second"] == 1.5
    assert ratios["benchmarks"] == {"mt-bench": 1.1} and ratios["meets_targets"] is True
    # τ at parity passes (≥ 1.0); samples/s 1.19x misses the 1.2 target
    assert quality.ours_over_peer(row(2.0, 23.8), row(2.0, 20.0))["meets_targets"] is False
    assert quality.ours_over_peer(row(2.0, 24.0), row(2.0, 20.0))["meets_targets"] is True


def test_ours_over_peer_leaves_a_ratio_open_where_the_peer_has_no_figure():
    ratios = quality.ours_over_peer(row(2.0, 24.0, **{"mt-bench": 2.0}), row(None, 20.0))
    assert ratios["heldout_acceptance_length"] is None and ratios["benchmarks"] == {"mt-bench": None}
    assert ratios["meets_targets"] is None


def test_the_probed_horizon_fills_the_budget_with_whole_steps():
    assert peer.horizon_steps(60.0, 0.5) == 120
    assert peer.horizon_steps(60.0, 0.7) == 86  # rounded up: the budget, not the horizon, ends the run
    assert peer.horizon_steps(1.0, 10.0) == 1
    with pytest.raises(ValueError, match="positive"):
        peer.horizon_steps(60.0, 0.0)


@pytest.mark.parametrize("flags,says", [
    (["--families", "eagle3", "--peer", "specforge", "--gpus", "cpu"], "1 devices for 1 families and the peer"),
    (["--families", "dflash", "--peer", "specforge", "--gpus", "cpu,cpu"], "add eagle3 to --families"),
])
def test_gpu_quality_refuses_a_peer_without_its_device_or_an_eagle3_row(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit):
        quality.main(["--config", "c.yaml", "--data", "d", "--answers", "4", *flags, "--out", str(tmp_path)])
    assert says in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any row started


def test_a_failed_regenerate_stage_ends_the_bench_before_any_row_naming_its_log(tiny_target_dir, tmp_path, capsys):
    base = tiny_base(tmp_path, tiny_target_dir, "prep")
    out = tmp_path / "out"
    code = quality.main(["--config", str(base), "--data", str(tmp_path / "no-prompts"), *COUNTS, "--regen-engine",
                         "hf", "--families", "eagle3", "--gpus", "cpu", "--out", str(out)])
    assert code == 1
    assert f"the regenerate stage failed (exit 2): see {out / 'regenerate.log'}" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["regenerate.log"]  # no row started
    said = (out / "regenerate.log").read_text()  # the stage names the missing prompts and the fix
    assert "no train prompts to answer" in said and "prompts-train-n4" in said and "run --stages data first" in said


@pytest.mark.parametrize("overrides,where", [
    ({"draft": {"family": "dflash"}}, "draft.family"),
    ({"draft": {"fc_norm": True, "norm_output": True}}, "draft.fc_norm"),
    ({"data": {"chat_template_kwargs": {"enable_thinking": False}}}, "data.chat_template_kwargs"),
])
def test_the_peer_trains_only_the_eagle3_familys_config(overrides, where):
    base = {"model": {"target": "t"}, "data": {"train_files": ["train.jsonl"]}}
    for section, fields in overrides.items():
        base.setdefault(section, {}).update(fields)
    with pytest.raises(ConfigError) as e:
        peer.check_peer_config(config_from_dict(base))
    assert where in e.value.where
    peer.check_peer_config(config_from_dict({"model": {"target": "t"}, "data": {"train_files": ["train.jsonl"]}}))


def test_the_peer_refuses_the_cpu_without_tritons_interpreter(tiny_target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    base = tiny_base(tmp_path, tiny_target_dir, "peer")
    code = peer.main(["--config", str(base), "--data", str(tmp_path / "data"), *COUNTS, "--minutes", "0.05"])
    assert code == 2 and "start this script with TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not (tmp_path / "peer" / "peer.json").exists()


def test_the_peers_evaluate_phase_needs_its_train_phase_first(tiny_target_dir, tmp_path, capsys):
    base = tiny_base(tmp_path, tiny_target_dir, "peer")
    args = ["--config", str(base), "--data", str(tmp_path / "data"), *COUNTS, "--minutes", "0.05"]
    code = peer.main([*args, "--phase", "evaluate"])
    assert code == 2 and "run --phase train first" in capsys.readouterr().err
    assert not (tmp_path / "peer" / "results.json").exists()


@pytest.fixture(scope="module")
def specforge():
    """``specforge`` 0.2.0 importable in this process (skips without it)."""
    path = SPECFORGE_PATH
    if path is None:
        pytest.skip(NO_SPECFORGE)
    if path and path not in sys.path:
        sys.path.append(path)
    import specforge as module

    return module


def tiny_batch(tokenizer, loss_from: int = 4):
    text = ["<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi, how are you?<|im_end|>\n",
            "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\nOne two<|im_end|>\n"]
    enc = tokenizer(text, padding=True, return_tensors="pt", add_special_tokens=False)
    loss_mask = enc["attention_mask"].clone()
    loss_mask[:, :loss_from] = 0
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "loss_mask": loss_mask}


def test_the_capture_gives_the_layers_outputs_and_the_logits_shifted_one_token(specforge, tiny_target_dir,
                                                                                tiny_tokenizer):
    """SpecForge's historical HF backend: aux = output of layer i (HF ``hidden_states[i+1]``),
    concatenated; ids and logits shifted left one token (zero-filled); the loss mask unshifted, [B, T, 1]."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    batch = tiny_batch(tiny_tokenizer)
    got = peer.HFTargetCapture(target, [1, 3, 5])(batch, torch.device("cpu")).tensors
    with torch.no_grad():
        ref = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    torch.testing.assert_close(got["hidden_state"], torch.cat([ref.hidden_states[i + 1] for i in (1, 3, 5)], -1))
    torch.testing.assert_close(got["target"][:, :-1], ref.logits[:, 1:])
    assert not got["target"][:, -1].any() and not got["input_ids"][:, -1].any()
    assert torch.equal(got["input_ids"][:, :-1], batch["input_ids"][:, 1:])
    assert torch.equal(got["loss_mask"], batch["loss_mask"][..., None])


def test_the_probe_steps_change_no_weight(specforge, tiny_target_dir, tiny_tokenizer):
    """The steps that time the horizon run SpecForge's whole step at learning rate 0: the draft
    after them is the draft before them, bit for bit; the same step at a learning rate moves it."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.modeling.auto import AutoDraftModel
    from transformers import AutoModelForCausalLM

    from specforge_core.drafts.eagle3.draft_config import draft_config_from_target

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    cfg = config_from_dict({"model": {"target": str(tiny_target_dir)}, "draft": {"draft_vocab_size": 64},
                            "training": {"ttt_length": 2}})
    dcfg = draft_config_from_target(target.config, 64)
    torch.manual_seed(0)
    draft = AutoDraftModel.from_config(dcfg, attention_backend="sdpa", torch_dtype=torch.float32)
    d2t, t2d = process_token_dict_to_mappings(Counter(), 64, dcfg.vocab_size)  # the first 64 ids
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=2, attention_backend="sdpa")
    batch = peer.HFTargetCapture(target, dcfg.eagle_config["eagle_aux_hidden_state_layer_ids"])(
        tiny_batch(tiny_tokenizer), torch.device("cpu"))
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    probe = peer.build_trainer(draft, model, peer.optimizer_factory(cfg, lr=0.0, total_steps=1), cfg)
    assert probe.train_step(batch).optimizer_stepped
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in before.items())
    trainer = peer.build_trainer(draft, model, peer.optimizer_factory(cfg, lr=1e-2, total_steps=10), cfg)
    trainer.train_step(batch)
    assert not torch.equal(draft.state_dict()["fc.weight"], before["fc.weight"])


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_target_dir):
    """bench/gpu_quality.py on the CPU, once for the module (its runs are most of this file's time):
    our EAGLE3 row and, where SpecForge 0.2.0 can be imported, the peer's row on a second device.
    ``(out, done)``: the output directory and the finished process."""
    tmp_path = tmp_path_factory.mktemp("gpu-quality")
    base = tiny_base(tmp_path, tiny_target_dir, "prep", heldout={"interval": 5, "num_prompts": 2, "max_new_tokens": 8})
    data = ["--config", str(base), "--data", str(tmp_path / "data"), *COUNTS]
    assert realcheck([*data, "--stages", "data"]) == 0  # the answers: the bench's --regen-engine
    with_peer = ["--peer", "specforge", "--gpus", "cpu,cpu"] if SPECFORGE_PATH is not None else ["--gpus", "cpu"]
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_quality.py"), *data, "--regen-engine", "hf",
           "--regen-batch-size", "4", "--new-tokens", "8", "--minutes", "0.05",
           "--families", "eagle3", *with_peer, "--benchmarks", "mt-bench", "--benchmark-limit", "1",
           "--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), SPECFORGE_PATH]))}
    return tmp_path / "out", subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_the_gpu_minute_bench_runs_the_chain_per_family_and_gathers_the_figures(bench_run):
    """bench/gpu_quality.py on a CPU: one family on one device, its run, held-out and benchmark τ."""
    out, done = bench_run
    assert done.returncode == 0, done.stdout[-2000:] + (out / "eagle3.log").read_text()[-3000:]
    result = json.loads((out / "quality.json").read_text())
    [row] = result["families"]
    run = json.loads((out / "eagle3" / "results.json").read_text())
    assert row["family"] == "eagle3" and row["samples"] == run["training"]["samples"] > 0
    assert row["heldout_acceptance_length"] == run["heldout"]["acceptance_length"] >= 1.0
    assert set(row["benchmarks"]) == {"mt-bench"} and row["benchmarks"]["mt-bench"] >= 1.0
    assert row["curve"] and (out / "quality.png").is_file() and not result["failed"]
    # --regen-engine made the 4 answers the rows trained on, before any row started
    made = result["regenerate"]
    assert made["engine"] == "hf" and made["written"] == made["rows"] == 4 and made["tokens_per_s"] > 0


@pytest.mark.slow
def test_the_peer_row_trains_specforge_and_our_evaluator_decodes_its_export(bench_run):
    """gpu_quality.py --peer specforge on the CPU: our EAGLE3 row and the peer's, the same answers."""
    if SPECFORGE_PATH is None:
        pytest.skip(NO_SPECFORGE)
    out, done = bench_run
    assert done.returncode == 0, done.stdout[-2000:] + (out / "peer.log").read_text()[-3000:]
    result = json.loads((out / "quality.json").read_text())
    [ours], theirs = result["families"], result["peer"]
    trainer = theirs["trainer"]
    assert theirs["samples"] == trainer["samples"] > 0 and trainer["steps"] >= 1 and trainer["tokens_per_second"] > 0
    assert theirs["samples_per_second"] == pytest.approx(trainer["samples"] / trainer["train_seconds"])
    assert trainer["attention_backend"] == "sdpa" and trainer["peer"] == "specforge==0.2.0"
    assert theirs["heldout_acceptance_length"] >= 1.0 and theirs["benchmarks"]["mt-bench"] >= 1.0
    ratios = result["ours_over_peer"]
    tau_ratio = ours["heldout_acceptance_length"] / theirs["heldout_acceptance_length"]
    assert ratios["heldout_acceptance_length"] == round(tau_ratio, 3)
    assert ratios["samples_per_second"] == round(ours["samples_per_second"] / theirs["samples_per_second"], 3)
    assert (out / "quality.png").is_file()
    # the held-out figure is our evaluator's decode of SpecForge's export, which our loader reads
    # as SpecForge wrote it: the weights of its checkpoint, in the export's bf16
    results = json.loads((out / "peer" / "results.json").read_text())
    assert f"--draft {out / 'peer' / 'draft'} " in results["heldout"]["command"]
    from specforge_core.drafts import load_draft

    family, draft = load_draft(out / "peer" / "draft")
    assert family.name == "eagle3"
    trained = torch.load(out / "peer" / "checkpoints" / "peer-latest" / "training_state.pt", weights_only=False)
    exported = load_file(out / "peer" / "draft" / "model.safetensors")
    assert set(exported) == set(trained["draft_state_dict"])
    for key, value in trained["draft_state_dict"].items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(draft.state_dict()[key], expected), key
