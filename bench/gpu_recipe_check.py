"""A 1-GPU recipe through ``python -m specforge_core.train``, against the bench and the dry run.

    python bench/gpu_recipe_check.py --prepare .gpu-recipe                 # CPU machine: target config, data, caches
    python bench/gpu_recipe_check.py --run .gpu-recipe --out DIR           # the GPU: random weights, 20 steps, compare
    python bench/gpu_recipe_check.py --prepare .gpu-dflash --recipe examples/gpu/qwen3-8b-dflash-1gpu.yaml

``--recipe`` picks the recipe (default ``examples/gpu/qwen3-8b-1gpu.yaml``; any ``*-1gpu.yaml``, the
DFlash and DSpark ones included); ``--run`` and ``--compare`` read it back from the folder.

``--prepare`` (where ``datasets`` is installed; the GPU node has none) writes, under the folder: the
recipe's target as config.json plus the tiny fixture tokenizer (``target/``), 400 tokenized rows
with the H200 bench's lengths (log-normal, median 800, σ 0.9, 64–4,096 tokens, a quarter prompt:
``bench/gpu_train.sharegpt_like_rows``), the recipe with those paths and ``training.max_steps=20``
(``recipe.yaml``), its prompt cache, vocab map, plan and run manifest (``run/run.json``), and the
dry run of that manifest (``dry_run.json``: the plan's real largest micro-step, not the bound). A
folder inside the project is written with project-relative paths, so it can be copied to the GPU
machine with the project; one elsewhere (``/tmp/...``) gets absolute paths and serves this machine only.

``--run`` saves random bf16 weights of the target's shape into ``target/`` (no download), runs
``python -m specforge_core.train --manifest run/run.json`` and compares, from ``metrics.jsonl``
(one record per step): end-to-end tokens/s over steps 6–20 (the plan's tokens of those steps over
their step times; steps 1–5 compile) and the run's peak allocated memory with the dry run's
estimate. EAGLE3 passes with both within 10 % of their references, tokens/s against the bench's
15.7k (bench/results/qwen3-8b-h200-run2.json). A DFlash or DSpark recipe has no bench figure at its
batch: it passes when the dry run's estimate (an upper bound for these families: every sample's
anchors, the worst packed row) holds within 10 % and the peak reserved memory stays within 78 GiB,
what an 80 GB card leaves beside the CUDA context. Results: ``RESULT {json}`` lines and
``DIR/recipe_check.json``. Steps over 3× the median step (a recompile at a new packed shape) are left
out of the steady-state figure and counted. The EAGLE3 recipe ran on the H200 2026-12-01 (docs/gpu.md).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCH_TOKENS_PER_S = 15717.4  # bench/results/qwen3-8b-h200-run2.json: train_compiled_tokens_per_s
WARMUP_STEPS = 5
BLOCK_FAMILY_RESERVED_GIB = 78  # an 80 GB card's 79.6 GiB less the CUDA context


def result(**kw) -> dict:
    print("RESULT " + json.dumps(kw), flush=True)
    return kw


def prepare(folder: Path, recipe: Path, rows: int = 400, overrides: tuple[str, ...] = ()) -> None:
    """CPU side: everything ``--run`` reads except the weights (see the module docstring)."""
    import yaml

    from bench.gpu_sglang_check import record_manifest
    from bench.gpu_train import sharegpt_like_rows
    from fixtures.gpu_targets import TARGET_CONFIGS, write_target_config
    from fixtures.tiny import build_tokenizer
    from specforge_core.config import dump_config, load_config
    from specforge_core.data.prompt_cache import open_prompt_cache
    from specforge_core.run.manifest import RunManifest
    from specforge_core.launch.dry_run import DatasetSize, dry_run
    from specforge_core.launch.preflight import check_target_files

    folder = folder.resolve()
    rel = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    target = write_target_config(folder / "target", next(n for n in TARGET_CONFIGS if recipe.stem.startswith(n)))
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(target)
    with open(folder / "data.jsonl", "w") as f:
        for row in sharegpt_like_rows(rows, len(tokenizer), seed=0):
            f.write(json.dumps(row) + "\n")
    cfg = load_config(recipe, [
        f"model.target={rel / 'target'}", f"data.train_files=[{rel / 'data.jsonl'}]", "data.format=tokenized",
        "data.eval_holdout=0", f"data.cache_dir={rel / 'cache'}", f"output.dir={rel / 'run'}",
        "training.max_steps=20", "training.log_interval=1", "training.save_interval=0", *overrides,
    ])
    config = folder / "recipe.yaml"
    config.write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    manifest = RunManifest.load(record_manifest(config))
    cache = open_prompt_cache(manifest.prompt_cache.path)
    report = dry_run(cfg, DatasetSize.of_prompt_cache(cache.rows("train"), str(cache.path)),
                     plan_path=manifest.plan.path, checked=check_target_files(cfg))
    print("\n".join(report.lines()))
    (folder / "dry_run.json").write_text(json.dumps(report.as_dict(), indent=1))


def save_random_weights(target: Path, device: str) -> None:
    """Random weights of the target's shape (bf16 on a GPU), saved beside its config and tokenizer;
    the GPU memory they took is handed back before the run starts (an 80 GB card needs all of it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def compare_recipe(folder: Path) -> dict:
    """tokens/s of steps after the warm-up and the peak allocated memory, against bench and dry run
    (the pass rule of the recipe's family: module docstring)."""
    from specforge_core.config import load_config
    from specforge_core.data.prompt_cache import open_prompt_cache
    from specforge_core.run.manifest import RunManifest
    from specforge_core.run.plan import PromptPlan

    manifest = RunManifest.load(folder / "run" / "run.json")
    plan = PromptPlan.load(manifest.plan.path)
    lengths = open_prompt_cache(manifest.prompt_cache.path).rows("train").column("length").astype("int64")
    per_step = plan.local_lengths(lengths).sum(dim=(1, 2)).view(plan.total_optimizer_steps, -1).sum(-1)
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in records if r["step"] > WARMUP_STEPS]
    # A step that meets a new packed shape recompiles (seconds, once); the bench's figure is a
    # steady state, so such steps (over 3× the median step) are left out, and counted.
    median = sorted(r["step_time_s"] for r in after)[len(after) // 2]
    timed = [r for r in after if r["step_time_s"] <= 3 * median]
    recompiles = [r["step"] for r in after if r["step_time_s"] > 3 * median]
    tokens_per_s = sum(int(per_step[r["step"] - 1]) for r in timed) / sum(r["step_time_s"] for r in timed)
    with_recompiles = sum(int(per_step[r["step"] - 1]) for r in after) / sum(r["step_time_s"] for r in after)
    peak = max(r.get("peak_mem_allocated_bytes") or r.get("peak_rss_bytes") or 0 for r in records)
    reserved = max(r.get("peak_mem_reserved_bytes") or 0 for r in records)
    estimate = json.loads((folder / "dry_run.json").read_text())["memory"]["peak_bytes"]
    family = load_config(folder / "recipe.yaml").draft.family
    figures = dict(phase="compare", family=family, steps=len(records), timed_steps=len(timed),
                   recompile_steps=recompiles, tokens_per_s_with_recompiles=round(with_recompiles),
                   tokens_per_s=round(tokens_per_s), peak_allocated_gib=round(peak / 2**30, 2),
                   peak_reserved_gib=round(reserved / 2**30, 2), dry_run_estimate_gib=round(estimate / 2**30, 2),
                   memory_ratio=round(peak / estimate, 3))
    if family != "eagle3":
        return result(**figures, ok=peak <= 1.10 * estimate and reserved <= BLOCK_FAMILY_RESERVED_GIB * 2**30)
    return result(**figures, bench_tokens_per_s=BENCH_TOKENS_PER_S,
                  tokens_per_s_ratio=round(tokens_per_s / BENCH_TOKENS_PER_S, 3),
                  ok=abs(tokens_per_s / BENCH_TOKENS_PER_S - 1) <= 0.10 and abs(peak / estimate - 1) <= 0.10)


def run(folder: Path, out: Path, device: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    save_random_weights(folder / "target", device)
    proc = subprocess.run([sys.executable, "-m", "specforge_core.train", "--manifest", str(folder / "run" / "run.json")],
                          cwd=ROOT, capture_output=True, text=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    results = [result(phase="train", returncode=proc.returncode)]
    if proc.returncode == 0:
        results.append(compare_recipe(folder))
    (out / "recipe_check.json").write_text(json.dumps(results, indent=1))
    return 0 if proc.returncode == 0 and results[-1].get("ok") else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", help="CPU side: build the check's inputs into this folder (inside the project, "
                    "to copy it to the GPU machine)")
    ap.add_argument("--run", help="GPU side: the folder --prepare built")
    ap.add_argument("--compare", help="GPU side, after --run: the comparison again from the run's metrics")
    ap.add_argument("--recipe", default=str(ROOT / "examples" / "gpu" / "qwen3-8b-1gpu.yaml"),
                    help="--prepare: the 1-GPU recipe to check (--run and --compare read it from the folder)")
    ap.add_argument("--out", default="/tmp/recipe-check")
    ap.add_argument("--device", default="cuda", help="where --run makes the random weights (cpu: a smoke test)")
    ap.add_argument("overrides", nargs="*", help="--prepare: dotted overrides of the recipe (a CPU smoke test)")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare), Path(args.recipe), overrides=tuple(args.overrides))
        return 0
    if args.run:
        return run(Path(args.run), Path(args.out), args.device)
    if args.compare:
        return 0 if compare_recipe(Path(args.compare))["ok"] else 1
    ap.error("give --prepare FOLDER or --run FOLDER")


if __name__ == "__main__":
    sys.exit(main())
