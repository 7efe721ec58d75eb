"""Gated promotion for scheduled retraining: the new draft replaces the promoted one only if it is better.

    decision = promotion_decision(new=1.42, promoted=1.38, margin=0.02)   # pure
    figure = compared_figure(report, promote_on="mt-bench")                # pure: what is compared
    promote(config, report)                                                # the Prefect task

The rule: promote when there is no promoted draft yet, or when the new draft's figure is more than
the promoted draft's plus ``validation.promote_margin``. The figure is the measured acceptance
length on the held-out prompts, or with ``validation.promote_on`` that benchmark's pooled
acceptance length at the first of ``validation.settings``. Both numbers come from the same
validate run (same prompts, same target, same decoding settings), so they compare like with like;
a new draft without a figure (nothing was decoded) is not promoted. The promoted directory is
replaced by a copy of the exported draft plus ``promotion.json`` (where it came from, what was
compared and its value), swapped in with renames so a reader never sees a half-copied draft. The
decision, promoted or not, is the ``promotion-decision`` artifact.
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
    new: float | None
    promoted: float | None
    margin: float


@dataclass(frozen=True)
class ComparedFigure:
    """What promotion compares: its name, the new draft's value and the promoted draft's (None: none measured)."""

    name: str
    new: float | None
    promoted: float | None


def compared_figure(report: dict, promote_on: str | None) -> ComparedFigure:
    """The measured acceptance lengths (held-out prompts) of the validate ``report``, or with ``promote_on`` that
    benchmark's pooled acceptance length at the first setting (``report["benchmarks"]`` and
    ``report["benchmarks_promoted"]``)."""
    if promote_on is None:
        return ComparedFigure("measured acceptance length (held-out prompts)", report["acceptance_length"],
                              report.get("acceptance_length_promoted"))
    first = report["benchmarks"][promote_on]["settings"][0]
    promoted = report.get("benchmarks_promoted")
    return ComparedFigure(
        f"measured acceptance length on {promote_on} at {first['steps']},{first['topk']},{first['draft_tokens']}",
        first["acceptance_length"],
        None if promoted is None else promoted[promote_on]["settings"][0]["acceptance_length"],
    )


def promotion_decision(new: float | None, promoted: float | None, margin: float) -> PromotionDecision:
    if new is None:
        return PromotionDecision(False, "the new draft has no measured figure (nothing was decoded): "
                                 "keeping the promoted draft", new, promoted, margin)
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
    """Promote the validated draft if its figure (held-out, or ``validation.promote_on``'s) beats the
    promoted one's by the margin."""
    promoted_dir = Path(config.validation.promoted_dir)
    figure = compared_figure(report, config.validation.promote_on)
    decision = promotion_decision(figure.new, figure.promoted, config.validation.promote_margin)
    if decision.promote:
        install_draft(Path(report["draft_dir"]), promoted_dir, {
            "source_draft": report["draft_dir"], "run_dir": report["run_dir"],
            "acceptance_length": report["acceptance_length"], "compared": figure.name,
            "value": decision.new, "replaced_value": decision.promoted,
            "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
    verdict = "**promoted**" if decision.promote else "**kept the promoted draft**"
    create_markdown_artifact(
        key="promotion-decision",
        markdown="\n".join([
            f"## Promotion: {verdict}", "",
            f"| | {figure.name} |", "|---|---|",
            f"| new draft (`{report['draft_dir']}`) | {'n/a' if decision.new is None else f'{decision.new:.3f}'} |",
            f"| promoted draft (`{promoted_dir}`) | "
            f"{'none yet' if decision.promoted is None else f'{decision.promoted:.3f}'} |",
            f"| required margin | {decision.margin:g} |", "",
            f"Reason: {decision.reason}.", "",
        ]),
        description="did this run's draft replace the promoted one?",
    )
    return {**asdict(decision), "figure": figure.name}
