"""Every 1-GPU recipe fits the GPU its header names: the dry run of ``examples/gpu/*-1gpu.yaml`` at
its target's shape (config.json only), at the recipe's bound (``batch_size × max_length`` tokens in
one micro-step), projects a peak within 95 % of the ``--gpu-gib`` of the header's dry-run command.
The block-family recipes (DFlash, DFlash2 through its documented override, DSpark) name an 80 GB GPU."""

import json
import re

import numpy as np
import pytest

from specforge_core.config import load_config
from specforge_core.launch.dry_run import GIB, DatasetSize, dry_run
from tests.runtime.test_dry_run import ROOT, recipe_args, run_dry, targets  # noqa: F401

ONE_GPU = sorted((ROOT / "examples" / "gpu").glob("*-1gpu.yaml"))
DFLASH = ROOT / "examples" / "gpu" / "qwen3-8b-dflash-1gpu.yaml"
DFLASH2 = ("draft.dflash.dflash2=true", "training.batch_size=3", "training.accumulation_steps=4")
HEADROOM = 0.95  # what allocated memory may use: the CUDA context and the allocator's slack need the rest
CASES = [(r, ()) for r in ONE_GPU] + [(DFLASH, DFLASH2)]


def header(recipe) -> str:
    text = recipe.read_text()
    return text[: text.index("\nmodel:")]


def named_gpu_gib(recipe) -> int:
    """The GPU memory the header's dry-run command checks against (``--dry-run --gpu-gib G``)."""
    found = re.findall(r"--dry-run --gpu-gib (\d+)", header(recipe))
    assert len(found) == 1, f"{recipe.name}: the header names no single --gpu-gib for its dry run"
    return int(found[0])


def projected_peak_gib(capsys, targets, recipe, overrides=()) -> float:  # noqa: F811
    code, lines, err = run_dry(capsys, "--rows", "100000", "--gpu-gib", str(named_gpu_gib(recipe)),
                               *recipe_args(recipe, targets, *overrides))
    assert code == 0, err
    report = json.loads(lines[-1])
    assert report["tokens_per_micro_step_per_rank"]["basis"].startswith("bound"), report
    return report["memory"]["peak_bytes"] / GIB


@pytest.mark.parametrize("recipe, overrides", CASES, ids=[r.stem + ("+dflash2" if o else "") for r, o in CASES])
def test_the_projected_peak_at_the_bound_fits_the_gpu_the_header_names(recipe, overrides, targets,  # noqa: F811
                                                                         capsys):
    gpu = named_gpu_gib(recipe)
    peak = projected_peak_gib(capsys, targets, recipe, overrides)
    assert peak <= HEADROOM * gpu, f"{recipe.name} {' '.join(overrides)}: {peak:.1f} GiB projected on a {gpu} GiB GPU"


def test_every_block_family_has_a_recipe_for_one_80_gb_gpu():
    families = {load_config(r).draft.family: r for r in ONE_GPU}
    for family in ("dflash", "dspark"):
        assert family in families, f"no 1-GPU recipe trains a {family} draft"
        assert named_gpu_gib(families[family]) == 80, families[family].name


@pytest.mark.parametrize("recipe", [r for r in ONE_GPU if load_config(r).draft.family != "eagle3"],
                         ids=lambda r: r.stem)
def test_the_header_states_the_dry_runs_projection(recipe, targets, capsys):  # noqa: F811
    peak = projected_peak_gib(capsys, targets, recipe)
    assert f"{peak:.1f} GiB — PROJECTED" in header(recipe), f"{recipe.name}: the dry run now projects {peak:.1f} GiB"


def test_the_dflash_estimate_bounds_the_h200_end_to_end_peak(targets):  # noqa: F811
    """bench/results/dflash-qwen3-8b-h200-2026-12-01.json: 5 layers, 512 anchors, 12 samples per step
    packed into rows of 16,384, peak 121.4 GiB allocated. Its largest row (these 12 samples, 16,241
    tokens, 5,543 anchors) is where building the flex block mask peaks; the dry run, which counts
    512 anchors for every sample, must not claim less than was measured, nor much more."""
    cfg = load_config(DFLASH, [f"model.target={targets['qwen3-8b']}", "training.batch_size=12",
                               "training.accumulation_steps=1"])
    lengths = np.array([2912, 664, 957, 1665, 878, 1496, 1478, 1022, 1782, 2802, 159, 426])
    report = dry_run(cfg, DatasetSize(12, "bench", lengths), gpu_bytes=140 * GIB)
    assert report.tokens["max"] == 16_241
    measured = 121.4
    assert measured <= report.memory["peak"] / GIB <= 1.2 * measured
