"""``python -m specforge_core.train --dry-run``: every GPU recipe resolves on a CPU from its target's
config.json alone, broken layouts are refused naming the field, and the printed numbers are the
plan's, the topology's and the model cards'."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fixtures.gpu_targets import TARGET_CONFIGS, write_target_config
from specforge_core.config import load_config
from specforge_core.launch.dry_run import GIB, DatasetSize, dry_run
from specforge_core.train import main
from specforge_core.run.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "examples" / "gpu").glob("*.yaml"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """A directory holding only config.json for each recipe target."""
    root = tmp_path_factory.mktemp("gpu-targets")
    return {name: write_target_config(root / name, name) for name in TARGET_CONFIGS}


def target_of(recipe: Path) -> str:
    return next(name for name in TARGET_CONFIGS if recipe.stem.startswith(name))


def run_dry(capsys, *argv: str) -> tuple[int, list[str], str]:
    """Exit code, stdout lines and stderr of ``python -m specforge_core.train --dry-run ARGV`` (in process);
    options come before ``--config C.yaml overrides...``."""
    code = main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def recipe_args(recipe: Path, targets, *overrides: str) -> list[str]:
    """``--config recipe`` with ``model.target`` at a directory holding the real config.json, then ``overrides``."""
    return ["--config", str(recipe), f"model.target={targets[target_of(recipe)]}", *overrides]


def test_there_are_one_gpu_eight_gpu_and_two_node_recipes_for_both_8b_targets():
    names = {p.stem for p in RECIPES}
    for model in ("qwen3-8b", "llama-3.1-8b"):  # SmolLM2-135M has its 1-GPU recipe only
        assert {f"{model}-1gpu", f"{model}-8gpu-tp1", f"{model}-8gpu-tp2", f"{model}-2node"} <= names
    assert "smollm2-135m-1gpu" in names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_passes_the_dry_run_and_fits_an_h200(recipe, targets, capsys):
    code, lines, err = run_dry(capsys, "--rows", "100000", "--gpu-gib", "140", *recipe_args(recipe, targets))
    assert code == 0, err
    report = json.loads(lines[-1])
    cfg = load_config(recipe)
    topo = report["topology"]
    assert topo["world_size"] == cfg.deployment.nproc_per_node * cfg.deployment.nnodes
    assert topo["num_islands"] * topo["tp_size"] == topo["world_size"] == sum(len(i) for i in topo["islands"])
    assert report["memory"]["fits"], report["memory"]
    assert (report["sglang"] is not None) == (cfg.capture.backend == "sglang")
    assert report["unresolved"] == []


def test_the_plan_numbers_are_the_dataset_over_world_batch_and_accumulation(targets, capsys):
    recipe = ROOT / "examples" / "gpu" / "qwen3-8b-8gpu-tp2.yaml"
    code, lines, err = run_dry(capsys, "--rows", "100003", *recipe_args(recipe, targets, "training.accumulation_steps=3"))
    assert code == 0, err
    report = json.loads(lines[-1])
    world, batch, accumulation = 8, 12, 3
    steps = 100003 // (world * batch * accumulation)
    assert report["plan"]["steps_per_epoch"] == steps == 347
    assert report["plan"]["dropped_per_epoch"] == 100003 - steps * world * batch * accumulation
    assert report["plan"]["samples_per_optimizer_step_per_rank"] == batch * accumulation
    assert report["topology"]["islands"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert report["tokens_per_micro_step_per_rank"]["max"] == batch * 4096  # the bound without row lengths
    text = "\n".join(lines[:-1])
    assert "world 8 = 4 islands × tp 2" in text and f"{steps} steps per epoch" in text
    assert "TP-wide batch 24" in text and "tokens per micro-step ≤ 49152" in text


def test_memory_parts_follow_the_model_card(targets, capsys):
    q = TARGET_CONFIGS["qwen3-8b"]
    h, i, v, layers, hd = q["hidden_size"], q["intermediate_size"], q["vocab_size"], q["num_hidden_layers"], q["head_dim"]
    heads, kv_heads = q["num_attention_heads"], q["num_key_value_heads"]
    per_layer = h * heads * hd * 2 + h * kv_heads * hd * 2 + 3 * h * i + 2 * h + 2 * hd  # q,o; k,v; MLP; norms
    params = layers * per_layer + 2 * v * h + h  # + untied embedding and head, final norm
    assert params == 8_190_735_360  # Qwen3-8B's published size
    reports = {}
    for name in ("qwen3-8b-1gpu", "qwen3-8b-8gpu-tp1", "qwen3-8b-8gpu-tp2"):
        code, lines, err = run_dry(capsys, "--rows", "100000", *recipe_args(ROOT / "examples" / "gpu" / f"{name}.yaml", targets))
        assert code == 0, err
        reports[name] = json.loads(lines[-1])
    hf = reports["qwen3-8b-1gpu"]["memory"]["parts_bytes"]
    assert hf["target"] == params * 2  # bf16, the whole target on the rank
    for name, tp in (("qwen3-8b-8gpu-tp1", 1), ("qwen3-8b-8gpu-tp2", 2)):
        report = reports[name]
        assert report["memory"]["parts_bytes"]["target"] == params * 2 // tp + 2 * v * h * 2  # shard + head copies
        kv = layers * 2 * (kv_heads // tp) * hd * 2
        assert report["sglang"]["kv_bytes_per_token"] == kv
        assert report["sglang"]["engine_args"]["max_total_tokens"] == tp * 12 * 4096
        assert report["memory"]["parts_bytes"]["kv_pool"] == tp * 12 * 4096 * kv
    assert reports["qwen3-8b-8gpu-tp2"]["memory"]["peak_bytes"] < reports["qwen3-8b-8gpu-tp1"]["memory"]["peak_bytes"]


CURVE = ROOT / "bench" / "results" / "long-context-h100-2026-12-06.json"
CURVE_POINTS = [p for p in json.loads(CURVE.read_text())["points"] if p["side"] == "ours" and "error" not in p]
# The block families as bench/gpu_train.py builds them: 5 layers (DFlash: block 16), Qwen3's mask token.
BENCH_FAMILIES = {
    "eagle3": (),
    "dflash": ("draft.family=dflash", "draft.dflash.num_layers=5", "draft.dflash.block_size=16",
               "draft.dflash.mask_token_id=151669"),
    "dspark": ("draft.family=dspark", "draft.dspark.num_layers=5", "draft.dspark.mask_token_id=151669"),
}
# DSpark's estimate of a short sample is high: its 512 anchors' layer activations are counted low and
# the gradients, which the forward's peak does not hold yet, in full (the two offsets of the other
# families nearly cancel); measured: +13 % at 4,096 tokens, +6 % at 32,768, level at 65,536.
TOLERANCE = {"dspark": 0.14}


@pytest.fixture(scope="module")
def long_target(tmp_path_factory) -> Path:
    """Qwen3-8B's config.json with its context extended past 65,536 positions (as the bench builds it)."""
    config = dict(TARGET_CONFIGS["qwen3-8b"], max_position_embeddings=65543)
    out = tmp_path_factory.mktemp("qwen3-8b-long")
    (out / "config.json").write_text(json.dumps(config))
    return out


def bench_estimate(target, sample: int, samples: int, *overrides: str):
    """The dry run of a bench step: ``samples`` samples of ``sample`` tokens in one micro-step,
    the 1-GPU recipe's draft (bf16 compute, TTT 7, Vd 32,000) as bench/gpu_train.py builds it."""
    cfg = load_config(ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml", [
        f"model.target={target}", f"data.max_length={sample}", f"training.batch_size={samples}",
        f"training.token_budget={sample * samples}", *overrides])
    return cfg, dry_run(cfg, DatasetSize(samples, "bench", np.full(samples, sample)), gpu_bytes=80 * GIB)


@pytest.mark.parametrize("point", CURVE_POINTS,
                         ids=lambda p: f"{p['family']}-{p['setting']}-{p['mode']}-{p['length']}")
def test_the_estimate_holds_the_measured_long_context_curve(targets, long_target, point):
    """Each point of the curve measured on an 80 GB H100 (eager, as the bench runs; with and without
    activation checkpointing): the estimate within 10 % of the peak allocated memory (DSpark:
    ``TOLERANCE``), and over the GPU where the point ran out of memory."""
    packed = point["mode"] == "packed"
    sample = 4096 if packed else point["length"]
    target = long_target if point["length"] > 40960 else targets["qwen3-8b"]
    overrides = ["training.compile=false", *BENCH_FAMILIES[point["family"]]]
    if point["setting"].endswith("+ckpt"):
        overrides.append("training.activation_checkpointing=true")
    _, report = bench_estimate(target, sample, point["length"] // sample, *overrides)
    if point.get("oom"):
        assert not report.fits
    else:
        measured = point["peak_allocated_gib"]
        error = (report.memory["peak"] / GIB - measured) / measured
        assert abs(error) < TOLERANCE.get(point["family"], 0.10), f"estimate {error:+.1%} of the measured peak"


def test_the_curve_holds_every_family_setting_and_mode_it_names():
    """The recorded curve is one run of all three families, both modes and the checkpointed setting."""
    seen = {(p["family"], p["setting"], p["mode"]) for p in CURVE_POINTS}
    for family in BENCH_FAMILIES:
        assert {(family, "eager", "single"), (family, "eager", "packed")} <= seen
    assert ("eagle3", "eager+ckpt", "single") in seen
    fitted = [p for p in CURVE_POINTS if p["setting"] == "eager+ckpt" and not p.get("oom")]
    assert max(p["length"] for p in fitted) == 32768 and max(p["peak_allocated_gib"] for p in fitted) < 79.6


def test_the_estimate_is_within_ten_percent_of_the_compiled_end_to_end_bench(targets):
    """bench/results/qwen3-8b-end-to-end-vs-peer-h200-2026-12-05.json: 52.1 GiB allocated with
    training.compile, batch 12, budget 16,384, its largest step ≈ 18.7k tokens."""
    cfg = load_config(ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml", [f"model.target={targets['qwen3-8b']}"])
    largest = DatasetSize(12, "bench", np.full(12, 1558))  # one micro-step of 12 × 1,558 = 18,696 tokens
    report = dry_run(cfg, largest, gpu_bytes=140 * GIB)
    assert report.tokens["max"] == 18_696
    assert abs(report.memory["peak"] / GIB - 52.1) / 52.1 < 0.10


def test_a_length_that_does_not_fit_names_activation_checkpointing_which_makes_it_fit(targets):
    """32k-token samples, eager: over an 80 GB GPU (the curve ran out of memory there); the refusal
    names the switch, which brings the estimate under it."""
    from specforge_core.errors import ConfigError

    cfg, report = bench_estimate(targets["qwen3-8b"], 32768, 1, "training.compile=false")
    with pytest.raises(ConfigError) as err:
        report.check_fits(cfg)
    assert err.value.where == "training.token_budget" and "training.activation_checkpointing: true" in err.value.fix
    assert "capture.tp_size" in err.value.fix and "data.max_length" in err.value.fix
    assert bench_estimate(targets["qwen3-8b"], 32768, 1, "training.compile=false",
                          "training.activation_checkpointing=true")[1].fits


def broken(capsys, recipe: str, targets, *overrides: str, options=("--rows", "1000")) -> str:
    """stderr of the dry run of ``recipe`` with ``overrides``, which must refuse it (exit code 2, a fix, no traceback)."""
    path = ROOT / "examples" / "gpu" / f"{recipe}.yaml"
    code, _, err = run_dry(capsys, *options, *recipe_args(path, targets, *overrides))
    assert code == 2 and "Traceback" not in err and "fix:" in err, err
    return err


def test_a_tp_size_that_does_not_divide_the_attention_heads_is_refused(targets, capsys):
    err = broken(capsys, "qwen3-8b-8gpu-tp2", targets, "capture.tp_size=3", "deployment.nproc_per_node=6")
    assert "capture.tp_size: capture.tp_size=3 does not divide the target's 32 attention heads" in err


def test_a_tp_size_that_does_not_divide_the_world_is_refused(targets, capsys):
    err = broken(capsys, "qwen3-8b-8gpu-tp2", targets, "capture.tp_size=3")
    assert "capture.tp_size=3 must divide the world size (deployment.nproc_per_node × nnodes = 8)" in err


def test_a_world_other_than_the_configs_is_refused(targets, capsys):
    err = broken(capsys, "llama-3.1-8b-8gpu-tp1", targets, options=("--rows", "1000", "--world", "4"))
    assert "deployment.nproc_per_node: 4 ranks are launched" in err and "= 8" in err


def test_engine_limits_below_one_tp_wide_batch_are_refused(targets, capsys):
    err = broken(capsys, "qwen3-8b-8gpu-tp2", targets, "capture.sglang.max_total_tokens=50000")
    assert "capture.sglang.max_total_tokens=50000 cannot hold one TP-wide batch (24 rows" in err


def test_a_kv_pool_that_memory_cannot_hold_is_refused_as_the_engine_start_refuses_it(targets, capsys):
    # 0.2 × 80 GiB = 16 GiB for SGLang: 15.3 GiB of weights leave room for ≈ 5k of the 49,152 tokens
    err = broken(capsys, "qwen3-8b-8gpu-tp1", targets, "capture.sglang.mem_fraction_static=0.2",
                 options=("--rows", "1000", "--gpu-gib", "80"))
    assert "capture.sglang.mem_fraction_static" in err and "one TP-wide batch needs 12 / 49152" in err
    assert "raise capture.sglang.mem_fraction_static" in err


def test_a_layer_id_sglang_cannot_capture_is_refused(targets, capsys):
    err = broken(capsys, "qwen3-8b-8gpu-tp1", targets, "model.capture_layer_ids=[1,17,35]")
    assert "model.capture_layer_ids: layer ids [1, 17, 35] cannot be captured by SGLang for a 36-layer target" in err


def test_a_dataset_smaller_than_one_optimizer_step_is_refused(targets, capsys):
    err = broken(capsys, "llama-3.1-8b-2node", targets, options=("--rows", "100"))
    assert "training.batch_size: the dataset has 100 prompts, fewer than one optimizer step needs" in err


def test_dflash_without_a_mask_token_reports_it_unresolved_and_still_sizes_the_draft(targets, capsys):
    recipe = ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml"
    code, lines, err = run_dry(capsys, "--rows", "1000", *recipe_args(recipe, targets, "draft.family=dflash"))
    assert code == 0, err
    report = json.loads(lines[-1])
    assert [u.split(":")[0] for u in report["unresolved"]] == ["draft.dflash.mask_token_id"]
    assert report["draft"]["capture_layer_ids"] == [18]  # one draft layer reads the middle layer
    assert report["draft"]["frozen_params"] == 0 and report["draft"]["trainable_params"] > 0
    q = TARGET_CONFIGS["qwen3-8b"]
    assert report["memory"]["parts_bytes"]["features"] == 12 * 4096 * 1 * q["hidden_size"] * 2  # K=1, no last hidden
    code, lines, _ = run_dry(capsys, "--rows", "1000",
                             *recipe_args(recipe, targets, "draft.family=dflash", "draft.dflash.mask_token_id=151669"))
    assert code == 0 and json.loads(lines[-1])["unresolved"] == []


def test_without_rows_the_training_files_are_counted(targets, tmp_path, capsys):
    jsonl, array = tmp_path / "a.jsonl", tmp_path / "b.json"
    jsonl.write_text("".join('{"text": "x"}\n' + ("\n" if k % 7 == 0 else "") for k in range(250)))
    array.write_text(json.dumps([{"text": "y"}] * 40))
    recipe = ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml"
    code, lines, err = run_dry(capsys, *recipe_args(recipe, targets, f"data.train_files=[{jsonl},{array}]",
                                                  "data.eval_holdout=10"))
    assert code == 0, err
    dataset = json.loads(lines[-1])["dataset"]
    assert dataset["rows"] == 250 + 40 - 10 and dataset["source"].startswith("counted in data.train_files")
    code, lines, _ = run_dry(capsys, *recipe_args(recipe, targets, f"data.train_files=[{jsonl}]",
                                                  "data.eval_holdout=10", "data.max_rows=100"))
    assert json.loads(lines[-1])["dataset"]["rows"] == 90


def test_missing_training_files_are_refused_naming_the_file(targets, tmp_path, capsys):
    err = broken(capsys, "qwen3-8b-1gpu", targets, f"data.train_files=[{tmp_path / 'none.jsonl'}]", options=())
    assert f"{tmp_path / 'none.jsonl'}: file not found" in err


def test_the_dry_run_options_need_dry_run(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", "C.yaml", "--world", "8"])
    assert e.value.code == 2 and "--world, --rows and --gpu-gib belong to --dry-run" in capsys.readouterr().err


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, tiny_target_dir):
    """A run manifest as the flow records it: a real prompt cache, vocab map and plan (tiny target)."""
    from specforge_core.capture.target_info import load_target_config
    from specforge_core.config import config_from_dict, dump_config
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.data.vocab import ensure_vocab_map
    from specforge_core.run.manifest import Ref, RunManifest
    from specforge_core.run.plan import PromptPlan

    root = tmp_path_factory.mktemp("recorded")
    with open(root / "chat.jsonl", "w") as f:  # 60 conversations of 3 to 80 words: rows far below max_length
        for k in range(60):
            words = " ".join(["hello world"] * (3 + (k * 37) % 78))
            f.write(json.dumps({"conversations": [{"role": "user", "content": f"say {k}"},
                                                  {"role": "assistant", "content": words}]}) + "\n")
    config = {"model": {"target": str(tiny_target_dir), "dtype": "float32"},
              "data": {"train_files": [str(root / "chat.jsonl")], "max_length": 1000, "cache_dir": str(root / "cache")},
              "draft": {"draft_vocab_size": 64},
              "training": {"batch_size": 2, "accumulation_steps": 2, "ttt_length": 3, "num_epochs": 2},
              "capture": {"device": "cpu"}, "deployment": {"nproc_per_node": 2}, "output": {"dir": str(root / "run")}}
    cfg = config_from_dict(config)
    cache = ensure_prompt_cache(cfg, load_tokenizer(cfg))
    vocab = ensure_vocab_map(cfg, cache, load_target_config(cfg).vocab_size)
    plan = PromptPlan.from_config(cfg, len(cache.rows()), topology=Topology.from_config(cfg))
    plan_path = plan.save(root / "plan.json")
    manifest = RunManifest(config=dump_config(cfg), prompt_cache=Ref(cache.key, str(cache.path)),
                           plan=Ref(plan.key, str(plan_path)), vocab_map=Ref(vocab.key, str(vocab.path)))
    return manifest.save(root / "run.json"), plan, cache


def test_a_manifest_gives_the_exact_rows_and_the_plans_largest_micro_step(recorded_run, capsys):
    manifest, plan, cache = recorded_run
    code, lines, err = run_dry(capsys, "--manifest", str(manifest))
    assert code == 0, err
    report = json.loads(lines[-1])
    assert report["dataset"]["rows"] == len(cache.rows()) and report["plan"]["key"] == plan.key
    rows = cache.rows()
    # no token_budget: each rank's rows are right-padded to its micro-step's longest sample
    per_step = [max(rows[t.prompt_index]["length"] for t in b.local_tasks) * plan.batch_size
                for rank in range(plan.world_size) for b in plan.island_batches(rank)]
    tokens = report["tokens_per_micro_step_per_rank"]
    assert tokens["basis"] == "plan and row lengths"
    assert tokens["max"] == max(per_step) < plan.batch_size * 1000  # tighter than the bound
    assert tokens["mean"] == pytest.approx(sum(per_step) / len(per_step))


def test_a_manifest_on_another_world_or_plan_is_refused(recorded_run, capsys):
    manifest, _, _ = recorded_run
    code, _, err = run_dry(capsys, "--manifest", str(manifest), "--world", "1")
    assert code == 2 and "deployment.nproc_per_node: 1 ranks are launched" in err
    code, _, err = run_dry(capsys, "--manifest", str(manifest), "training.batch_size=3")
    assert code == 2 and "the recorded plan was made for another configuration" in err and "batch_size: 2 → 3" in err


def test_every_recipe_header_labels_its_figures_measured_or_projected():
    for recipe in RECIPES:
        text = recipe.read_text()
        header = text[: text.index("\nmodel:")]
        assert all(line.startswith("#") for line in header.splitlines() if line), recipe.name
        assert "--dry-run" in header and "prefect deployment run colocated-train/" + recipe.stem in header
        speed, memory = header.split("#   tokens/s")[1].split("#   peak memory")
        assert ("MEASURED" in speed or "PROJECTED" in speed) and "GiB" in memory, recipe.name
        assert "MEASURED" in memory or "PROJECTED" in memory, recipe.name
        assert yaml.safe_load(text)["model"]["target"].startswith("/models/")


def test_a_length_the_gpu_cannot_hold_is_refused_naming_max_length_and_the_fixes(targets, capsys):
    recipe = ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml"
    args = recipe_args(recipe, targets, "data.max_length=32768", "training.token_budget=null")
    code, lines, err = run_dry(capsys, "--rows", "1000", "--gpu-gib", "80", *args)
    assert code == 2
    assert any(line.startswith("memory per GPU") for line in lines)  # the layout is shown first
    assert "error: data.max_length: the memory estimate" in err and "exceeds the GPU's 80 GiB" in err
    assert "lower data.max_length" in err and "capture.tp_size" in err
    assert run_dry(capsys, "--rows", "1000", "--gpu-gib", "140", *recipe_args(recipe, targets))[0] == 0  # its GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="a visible GPU gives the size")
def test_without_a_gpu_size_an_excess_is_only_a_warning(targets, capsys):
    recipe = ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml"  # 125.9 GiB at its bound: an H200 recipe
    code, lines, err = run_dry(capsys, "--rows", "1000", *recipe_args(recipe, targets))
    assert code == 0, err
    assert any(line.startswith("warning: the estimate exceeds 80 GiB") and "--gpu-gib" in line for line in lines)
    assert json.loads(lines[-1])["memory"]["fits"] is False
