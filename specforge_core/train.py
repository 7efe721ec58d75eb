"""Train a draft, colocated: every rank captures its own target batch on demand and trains.

    torchrun --standalone --nproc_per_node 2 -m specforge_core.train --config examples/tiny-cpu.yaml
    python -m specforge_core.train --config C.yaml training.max_steps=20        # one process, CPU is fine
    torchrun ... -m specforge_core.train --config C.yaml --plan runs/x/plan.json  # a recorded plan
    torchrun ... -m specforge_core.train --manifest runs/x/run.json               # what the flow runs
    python -m specforge_core.train --config C.yaml --dry-run [--world 8] [--rows N]  # check a layout on a CPU

``deployment.nproc_per_node × nnodes`` must equal the number of ranks torchrun starts. Lifecycle:
parse → preflight (config files only) → resolve the inputs (prompt cache, vocab map, plan: from
the manifest by path, or built/found by rank 0) → build (target + capture backend, draft,
objective, trainer: ``launch/builder.py``) → train (resume if the run has checkpoints, train to
the plan's horizon, save) → close. Rank 0 holds ``<output.dir>/RUN.lock`` for the whole run,
prints ``step=i/N loss=...`` lines and writes ``metrics.jsonl``; checkpoints go to
``<output.dir>/checkpoints``. Exit code 2 on a configuration, data, model, resume or checkpoint
error (the message says where and what to do). A rank that finished (process group destroyed)
exits 0 through ``exit_after_success`` (stdio and logging flushed, then ``os._exit``), not the
interpreter's teardown, where torch's gloo threads can abort a finished rank (distributed.py).

Without ``--plan`` or ``--manifest`` the plan is built from the config and the prompt cache and
recorded as ``<output.dir>/plan.json`` when the run starts fresh, and ``<output.dir>/run.json``
records the resolved inputs; with ``--plan`` the recorded plan must be the one this config and
data give. With ``--manifest`` the config is the one recorded in the manifest (overrides still
apply on top).

``--dry-run`` starts no rank: it resolves the launch of ``--world`` ranks (default: the config's)
on this machine, from the target's config.json alone — topology, draft config, plan, SGLang engine
arguments and pools, a memory estimate per GPU — through the checks the launch runs, prints the
layout and one JSON line, and refuses a broken layout as the launch would (exit code 2, the field
and the fix), and a layout whose memory estimate exceeds ``--gpu-gib`` or the visible GPU (the layout is printed,
then the error names the field behind the largest part and how to lower it). ``launch/dry_run.py`` says what it checks, where the dataset size comes from
(``--rows``, the manifest's prompt cache, or the rows of ``data.train_files`` counted) and the
memory formula.
"""

import sys

from specforge_core.cli import command_parser, report_error
from specforge_core.errors import SpecForgeError


def parse_args(argv: list[str] | None = None):
    ap = command_parser(__doc__, "python -m specforge_core.train", config_required=False)
    ap.add_argument("--plan", help="a recorded plan.json (default: build it from the config and data)")
    ap.add_argument("--manifest", help="a run manifest (run.json) recorded by the flow: config and inputs by path")
    dry = ap.add_argument_group("dry run (launch/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true",
                     help="check and print the layout on this machine: no weights, no tokenizer, no processes")
    dry.add_argument("--world", type=int, help="the ranks torchrun will start (default: the config's world size)")
    dry.add_argument("--rows", type=int, help="training rows to plan for (default: the manifest's prompt cache, "
                     "else the rows of data.train_files counted)")
    dry.add_argument("--gpu-gib", type=float, help="memory of one GPU in GiB (default: the visible GPU's, else 80)")
    args = ap.parse_args(argv)
    if bool(args.config) == bool(args.manifest):
        ap.error("give exactly one of --config and --manifest")
    if args.manifest and args.plan:
        ap.error("--plan comes from the manifest; give one or the other")
    if not args.dry_run and (args.world, args.rows, args.gpu_gib) != (None, None, None):
        ap.error("--world, --rows and --gpu-gib belong to --dry-run")
    if args.manifest and args.rows is not None:
        ap.error("--rows: the manifest's prompt cache gives the rows; give one or the other")
    return args


def load_run(args):
    """``(config, manifest or None)`` of the parsed arguments."""
    from specforge_core.config import apply_overrides, config_from_dict, load_config
    from specforge_core.drafts import check_config
    from specforge_core.run.manifest import RunManifest

    if args.config:
        return check_config(load_config(args.config, args.overrides)), None
    manifest = RunManifest.load(args.manifest)
    data = apply_overrides(manifest.config, args.overrides) if args.overrides else manifest.config
    return check_config(config_from_dict(data, source=f"{args.manifest}: config")), manifest


def print_dry_run(args) -> int:
    """``--dry-run``: resolve and check the launch, print its layout and one JSON line; no rank starts."""
    from specforge_core.cli import run_command

    def body() -> dict:
        from specforge_core.launch.dry_run import GIB, DatasetSize, dry_run, manifest_dataset
        from specforge_core.launch.preflight import check_target_files

        cfg, manifest = load_run(args)
        world = cfg.deployment.world_size if args.world is None else args.world
        checked = check_target_files(cfg)
        if args.rows is not None:
            dataset = DatasetSize.given(args.rows)
        elif manifest is not None:
            dataset = manifest_dataset(manifest, cfg, checked, world)
        else:
            dataset = DatasetSize.counted(cfg)
        report = dry_run(cfg, dataset, world_size=world, plan_path=args.plan, checked=checked,
                         gpu_bytes=None if args.gpu_gib is None else int(args.gpu_gib * GIB))
        print("\n".join(report.lines()), flush=True)
        report.check_fits(cfg)
        return report.as_dict()

    return run_command(body)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return print_dry_run(args)
    from specforge_core.system.host import keep_freed_memory, prefer_passive_omp_wait

    prefer_passive_omp_wait()  # before torch is imported (system/host.py says why)
    # Before anything touches CUDA: the allocator reads its configuration once, at initialisation.
    from specforge_core.system.distributed import close_distributed, enable_expandable_segments, init_distributed
    from specforge_core.launch.builder import launch_rank

    enable_expandable_segments()
    try:
        cfg, manifest = load_run(args)
        d = init_distributed(cfg.capture.device)
        if d.device.type == "cpu":
            keep_freed_memory()
    except SpecForgeError as e:
        return report_error(e)
    try:
        launch_rank(cfg, d, manifest=manifest, plan_path=args.plan)
    except SpecForgeError as e:
        return report_error(e, f"error (rank {d.rank})")
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0:  # a finished rank leaves without the interpreter's teardown (distributed.py says why)
        from specforge_core.system.distributed import exit_after_success

        exit_after_success()
    sys.exit(code)
