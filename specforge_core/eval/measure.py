"""Measure a draft's acceptance by real speculative decoding over held-out prompts.

``measure_acceptance`` decodes every prompt with the target plus the draft (chain drafting,
greedy verification) and pools the counts (``eval.acceptance``). With ``check_lossless`` it
also decodes every prompt with the target alone and compares the outputs token for token:
speculation must never change the target's greedy output.
"""

import time

from specforge_core.eval.acceptance import AcceptanceStats
from specforge_core.eval.draft_runner import DraftRunner
from specforge_core.eval.speculative import decode
from specforge_core.eval.target import DecodingTarget


def measure_acceptance(model, draft, prompts: list[list[int]], *, stop_ids: set[int], capture_layer_ids: list[int],
                       num_steps: int, max_new_tokens: int, check_lossless: bool = False) -> dict:
    """Acceptance figures (``AcceptanceStats.summary``) plus timing and the losslessness check.

    ``model``: the HF target; ``draft``: an ``Eagle3DraftModel`` on the same device whose
    embedding is the target's; ``prompts``: token ids ending with the generation prompt.
    """
    target = DecodingTarget(model, capture_layer_ids)
    runner = DraftRunner(draft)
    stats = AcceptanceStats(num_steps)
    mismatched = []
    spec_s = greedy_s = 0.0
    try:
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            gen = decode(target, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                         drafter=runner, num_steps=num_steps)
            spec_s += time.perf_counter() - t0
            stats.add(gen)
            if check_lossless:
                t0 = time.perf_counter()
                plain = decode(target, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                greedy_s += time.perf_counter() - t0
                if plain.tokens != gen.tokens:
                    mismatched.append(i)
    finally:
        target.close()
    result = stats.summary()
    result["seconds"] = round(spec_s, 3)
    result["tokens_per_s"] = round(stats.generated_tokens / spec_s, 2) if spec_s else None
    result["lossless"] = None if not check_lossless else not mismatched
    if check_lossless:
        result["mismatched_prompts"] = mismatched
        result["greedy_seconds"] = round(greedy_s, 3)
    return result
