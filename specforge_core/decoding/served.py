"""The acceptance length SGLang itself reports when it serves an exported draft.

    spec, k = speculative_arguments(export_dir, num_steps=3)      # SGLang's speculative options
    served = served_acceptance(cfg, export_dir, prompts, num_steps=3, max_new_tokens=96, stop_ids=stops)
    compared = compare_served(ours["acceptance_length"], served["acceptance_length"])

SGLang 0.5.14 serves an EAGLE3 export (EAGLE-3.1's ``fc_norm`` and ``norm_output`` included) with
``speculative_algorithm="EAGLE3"``, ``speculative_num_steps=k``, ``speculative_eagle_topk=1`` and
``speculative_num_draft_tokens=k+1`` (chain drafting, as our evaluator decodes), and a DFlash export
with ``speculative_algorithm="DFLASH"`` and ``speculative_num_draft_tokens`` = its block size (its
verify window: the block less one draft tokens a pass, so ours must draft as many); it has no
DFlash2 (convolution, selector) and no DSpark. The engine is started as ``regenerate --engine
sglang`` starts it (``capture.sglang``'s settings, prompts in as token ids),
with the draft added; every prompt is decoded greedily under the same stop tokens as ours. SGLang
counts its verify passes per request (``meta_info["spec_verify_ct"]``); the first token of each
answer comes from the prefill, so τ = (completion tokens − requests) / verify passes, the count our
evaluator makes. ``compare_served`` holds the two within 5 % and says why they may differ.
"""

import json
from pathlib import Path

from specforge_core.errors import ConfigError

TOLERANCE = 0.05
WHY = ("SGLang computes in the model's dtype (bf16 kernels) and our evaluator in the target's own dtype: at a "
       "near-tied argmax the two take different tokens, and from there decode different text")


def speculative_arguments(export_dir: str | Path, num_steps: int | None = None) -> tuple[dict, int]:
    """SGLang 0.5.14's speculative options for the export at ``export_dir`` and the draft tokens per
    verify pass (``num_steps``, or the family's natural setting: 3 for EAGLE3, a block less one for
    DFlash). ConfigError for an export SGLang 0.5.14 cannot serve."""
    from specforge_core.drafts import family_of_files

    family = family_of_files(export_dir)
    config = json.loads((Path(export_dir) / "config.json").read_text(encoding="utf-8"))
    if family.name == "eagle3":
        k = num_steps or 3
        return dict(speculative_algorithm="EAGLE3", speculative_num_steps=k, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=k + 1), k
    dflash = config.get("dflash_config") or {}
    if family.name != "dflash" or any(key in dflash for key in ("conv_kernel_size", "selector_rank")):
        raise ConfigError(
            f"{export_dir}: SGLang 0.5.14 serves EAGLE3 (EAGLE-3.1 included) and DFlash drafts, not "
            f"{config.get('architectures')}", where="validation.engine",
            fix="set validation.engine: ours for DFlash2 and DSpark drafts (docs/families.md says who serves them)")
    block = int(config.get("block_size") or dflash.get("block_size"))
    k = num_steps or block - 1
    if k != block - 1:  # SGLang's DFLASH drafts its whole block every verify pass
        raise ConfigError(f"{k} draft tokens per verify pass; SGLang serves a DFlash draft with its whole block, "
                          f"{block - 1} draft tokens", where="validation.num_steps",
                          fix=f"leave validation.num_steps unset, or set it to {block - 1}")
    return dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=block), k


def served_acceptance(cfg, export_dir: str | Path, prompts: list[list[int]], *, num_steps: int | None,
                      max_new_tokens: int, stop_ids: set[int], engine_factory=None) -> dict:
    """SGLang's own figures for ``prompts`` decoded with the export at ``export_dir`` (module doc):
    ``acceptance_length``, ``verify_passes``, ``generated_tokens``, ``requests``, ``num_steps``,
    ``speculative`` (the options). ``engine_factory(**kwargs)`` stands in for ``sglang.Engine``."""
    from specforge_core.decoding.answering import sglang_engine_kwargs

    spec, k = speculative_arguments(export_dir, num_steps)
    if engine_factory is None:
        from specforge_core.capture.sglang_engine import start_generation_engine as engine_factory
    engine = engine_factory(**sglang_engine_kwargs(cfg, cfg.training.seed), speculative_draft_model_path=str(export_dir),
                            **spec)
    try:
        outputs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": max_new_tokens, "stop_token_ids": sorted(stop_ids)})
    finally:
        engine.shutdown()
    verify = sum(int(o["meta_info"]["spec_verify_ct"]) for o in outputs)
    tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outputs)
    return {"acceptance_length": (tokens - len(outputs)) / verify if verify else None, "verify_passes": verify,
            "generated_tokens": tokens, "requests": len(outputs), "num_steps": k, "speculative": spec}


def compare_served(ours: float | None, served: float | None) -> dict:
    """``served / ours``, whether it is within 5 %, and why the two may differ when it is not."""
    if not ours or served is None:
        return {"ratio": None, "within_5_percent": None, "note": "nothing to compare: no verify pass on one side"}
    ratio = served / ours
    ok = abs(ratio - 1) <= TOLERANCE
    return {"ratio": ratio, "within_5_percent": ok, "note": None if ok else WHY}


def served_section(ours: float | None, served: dict) -> str:
    """The report's section: SGLang's figure beside ours on the same prompts."""
    def f(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = ["", "## Served by SGLang", "",
             f"The exported draft served by SGLang 0.5.14 ({served['speculative']['speculative_algorithm']}, "
             f"{served['num_steps']} draft tokens a verify pass) on the same {served['requests']} prompts and stop tokens:",
             "", "| | acceptance length | verify passes | generated tokens |", "|---|---|---|---|",
             f"| our evaluator | {f(ours)} | | |",
             f"| SGLang | {f(served['acceptance_length'])} | {served['verify_passes']} | {served['generated_tokens']} |",
             "", f"SGLang / ours: {f(served['ratio'])}"
             + ("" if served["within_5_percent"] is None else " (within 5 %)" if served["within_5_percent"]
                else f" (more than 5 % apart: {served['note']})"), ""]
    return "\n".join(lines)
