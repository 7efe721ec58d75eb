"""A run directory and every file in it, named once.

    run = RunDir(cfg.output.dir)
    run.manifest, run.plan, run.config, run.metrics, run.checkpoints, run.lock, run.report_dir

Layout (``output.dir``, or ``<output.dir>/<flow run>-<id>`` when the flow runs it)::

    run.json            the run manifest: resolved config, prompt cache, vocab map, plan (run/manifest.py)
    config.yaml         the run config the flow's train task recorded for people (credentials masked)
    plan.json           the prompt plan (run/plan.py): the authority on who trains what
    metrics.jsonl       one record per log interval (run/metrics_file.py)
    RUN.lock            held by rank 0 while a run trains here (loop/run_lock.py)
    train.log           every line torchrun printed (the flow's train task)
    train.tree          the launched process tree, for stopping it after a crash (tasks/process_group.py)
    checkpoints/        step-NNNNNNNN/ directories and ``latest`` (loop/checkpoint.py)
    compile-cache/      torch.compile's inductor/Triton caches on CUDA: a resumed run reuses them
                        (system/compile.py; absent on CPU, where nothing is compiled). A flow run's
                        ranks use their run directory's parent's instead (shared_compile_cache)
    draft/              the exported draft (validate stage)
    draft-untrained/    an untrained draft of the same config, the "before" of a cold start
    validation.md       the evaluator's report when it is run by hand
    benchmarks.md       the evaluator's benchmark table when it is run by hand (--benchmarks)
    report/             report.md, curves.png, validation-<label>.md, benchmarks-<label>.md (validate stage)
"""

from dataclasses import dataclass
from pathlib import Path

from specforge_core.run.metrics_file import METRICS_FILE, MetricsFile

COMPILE_CACHE = "compile-cache"


def shared_compile_cache(output_dir: str | Path) -> Path:
    """The compile cache every flow run under ``output_dir`` shares, beside their run directories
    (absolute: the ranks may start in another directory)."""
    return (Path(output_dir) / COMPILE_CACHE).resolve()


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    @property
    def manifest(self) -> Path:
        return self.root / "run.json"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    def metrics_file(self) -> MetricsFile:
        return MetricsFile(self.metrics)

    @property
    def lock(self) -> Path:
        return self.root / "RUN.lock"

    @property
    def train_log(self) -> Path:
        return self.root / "train.log"

    @property
    def process_tree(self) -> Path:
        return self.root / "train.tree"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def compile_cache(self) -> Path:
        return self.root / COMPILE_CACHE

    @property
    def draft(self) -> Path:
        return self.root / "draft"

    @property
    def untrained_draft(self) -> Path:
        return self.root / "draft-untrained"

    @property
    def evaluation_report(self) -> Path:
        return self.root / "validation.md"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    @property
    def report(self) -> Path:
        return self.report_dir / "report.md"

    @property
    def curves(self) -> Path:
        return self.report_dir / "curves.png"

    def validation_report(self, label: str) -> Path:
        return self.report_dir / f"validation-{label}.md"

    @property
    def benchmark_report(self) -> Path:
        return self.root / "benchmarks.md"

    def validation_benchmarks(self, label: str) -> Path:
        return self.report_dir / f"benchmarks-{label}.md"
