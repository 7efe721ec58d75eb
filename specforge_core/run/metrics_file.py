"""``metrics.jsonl``: one JSON object per log interval, appended by rank 0; read by everyone else.

    metrics = MetricsFile(run_dir.metrics)
    metrics.append(record)              # the trainer (rank 0), one line, flushed
    metrics.records()                   # every whole line, oldest first (a torn last line is skipped)
    metrics.last(at_step=400)           # the newest record at or before step 400, or None
    metrics.truncate_after(step)        # before resuming at ``step``: drop a crashed attempt's tail

The one module that writes or parses the file: the trainer's metrics logger, the evaluator's
report (the simulated figures of a checkpoint), the Prefect table artifact and the curves plot
all go through it. A record always has ``step`` and ``total_steps``; the rest is listed in
``loop/metrics.py``.
"""

import json
import math
from pathlib import Path

from specforge_core.io import atomic_write_text

METRICS_FILE = "metrics.jsonl"


class MetricsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        """Every parseable record, in file order (a line torn by a crashed writer is skipped)."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                out.append(row)
        return out

    def last(self, at_step: int | None = None) -> dict | None:
        """The newest record, or with ``at_step`` the newest logged at or before that optimizer step."""
        for row in reversed(self.records()):
            if at_step is None or row.get("step", 0) <= at_step:
                return row
        return None

    def truncate_after(self, step: int) -> None:
        """Keep only records of steps ≤ ``step`` (atomically: a crash keeps the old history whole)."""
        if not self.path.is_file():
            return
        kept = [r for r in self.records() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def size(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else 0


def _cell(v):
    if isinstance(v, float):
        return float(f"{v:.5g}") if math.isfinite(v) else None
    return v if isinstance(v, (int, str, bool)) or v is None else json.dumps(v)


def metrics_rows(path: Path, max_rows: int = 200) -> list[dict]:
    """The newest ``max_rows`` records of a metrics.jsonl as rows with one column set, values
    rounded to 5 significant digits and non-finite ones None (a torn last line, written while
    we read, is skipped): what the UI's table and the curves read."""
    rows = MetricsFile(path).records()[-max_rows:]
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return [{c: _cell(row.get(c)) for c in columns} for row in rows]
