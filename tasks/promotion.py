"""Gated promotion for scheduled retraining: the new draft replaces the promoted one only if it is better.

    decision = promotion_decision(new=1.42, promoted=1.38, margin=0.02)   # pure
    promote(config, report)                                                # the Prefect task

The rule: promote when there is no promoted draft yet, or when the new draft's measured acceptance
length is more than the promoted draft's plus ``validation.promote_margin``. Both numbers come
from the same validate run (same held-out prompts, same target, same decoding settings), so they
compare like with like. The promoted directory is replaced by a copy of the exported draft plus
``promotion.json`` (where it came from, its acceptance length), swapped in with renames so a
reader never sees a half-copied draft. The decision, promoted or not, is the
``promotion-decision`` artifact.
"""

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from specforge_core.config import RunConfig

RECORD = "promotion.json"


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reason: str
    new: float
    promoted: float | None
    margin: float


def promotion_decision(new: float, promoted: float | None, margin: float) -> PromotionDecision:
    if promoted is None:
        return PromotionDecision(True, "no promoted draft yet", new, None, margin)
    if new > promoted + margin:
        return PromotionDecision(True, f"{new:.3f} > {promoted:.3f} + margin {margin:g}", new, promoted, margin)
    return PromotionDecision(False, f"{new:.3f} ≤ {promoted:.3f} + margin {margin:g}: keeping the promoted draft",
                             new, promoted, margin)


def install_draft(draft_dir: Path, promoted_dir: Path, record: dict) -> None:
    """Replace ``promoted_dir`` by a copy of ``draft_dir`` with ``record`` as promotion.json."""
    promoted_dir = Path(promoted_dir)
    promoted_dir.parent.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.time_ns()}"
    incoming = promoted_dir.with_name(f".{promoted_dir.name}.incoming-{stamp}")
    outgoing = promoted_dir.with_name(f".{promoted_dir.name}.outgoing-{stamp}")
    shutil.copytree(draft_dir, incoming)
    (incoming / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if promoted_dir.exists():
        promoted_dir.rename(outgoing)
    incoming.rename(promoted_dir)
    shutil.rmtree(outgoing, ignore_errors=True)


def promoted_record(promoted_dir: str | Path | None) -> dict | None:
    path = Path(promoted_dir) / RECORD if promoted_dir else None
    return json.loads(path.read_text()) if path and path.is_file() else None


@task(name="promote", cache_policy=NO_CACHE)
def promote(config: RunConfig, report: dict) -> dict:
    """Promote the validated draft if its measured acceptance length beats the promoted one by the margin."""
    promoted_dir = Path(config.validation.promoted_dir)
    decision = promotion_decision(report["acceptance_length"], report.get("acceptance_length_promoted"),
                                  config.validation.promote_margin)
    if decision.promote:
        install_draft(Path(report["draft_dir"]), promoted_dir, {
            "source_draft": report["draft_dir"], "run_dir": report["run_dir"],
            "acceptance_length": decision.new, "replaced_acceptance_length": decision.promoted,
            "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
    verdict = "**promoted**" if decision.promote else "**kept the promoted draft**"
    create_markdown_artifact(
        key="promotion-decision",
        markdown="\n".join([
            f"## Promotion: {verdict}", "",
            "| | acceptance length |", "|---|---|",
            f"| new draft (`{report['draft_dir']}`) | {decision.new:.3f} |",
            f"| promoted draft (`{promoted_dir}`) | "
            f"{'none yet' if decision.promoted is None else f'{decision.promoted:.3f}'} |",
            f"| required margin | {decision.margin:g} |", "",
            f"Reason: {decision.reason}.", "",
        ]),
        description="did this run's draft replace the promoted one?",
    )
    return asdict(decision)
