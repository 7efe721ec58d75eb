"""Measure a draft's acceptance by real speculative decoding over held-out prompts.

``measure_acceptance`` decodes the prompts with the target plus the draft (chain drafting,
greedy verification), ``batch_size`` prompts at a time, and pools the counts
(``decoding.acceptance``). With ``check_lossless`` it also decodes every prompt with the target alone
and compares the outputs token for token: speculation must never change the target's greedy
output.
"""

import time

from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.decoding.speculative import decode_batch
from specforge_core.decoding.verifier import DecodingTarget


def measure_acceptance(model, drafter, prompts: list[list[int]], *, stop_ids: set[int], capture_layer_ids: list[int],
                       num_steps: int, max_new_tokens: int, batch_size: int = 8,
                       check_lossless: bool = False) -> dict:
    """Acceptance figures (``AcceptanceStats.summary``) plus timing and the losslessness check.

    ``model``: the HF target; ``drafter``: the draft family's decoding step
    (``family.drafter(draft)``, a ``decoding.speculative.Drafter``) on the same device; ``prompts``: token ids ending with the generation prompt.
    Batching only shares the weight reads (each prompt is decoded as if alone); prompts of
    similar length are batched together.
    """
    target = DecodingTarget(model, capture_layer_ids)
    stats = AcceptanceStats(num_steps)
    mismatched = []
    spec_s = greedy_s = 0.0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = [prompts[i] for i in chunk]
            t0 = time.perf_counter()
            gens = decode_batch(target, batch, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                drafter=drafter, num_steps=num_steps)
            spec_s += time.perf_counter() - t0
            for gen in gens:
                stats.add(gen)
            if check_lossless:
                t0 = time.perf_counter()
                plain = decode_batch(target, batch, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                greedy_s += time.perf_counter() - t0
                mismatched += [i for i, g, p in zip(chunk, gens, plain) if g.tokens != p.tokens]
    finally:
        target.close()
    result = stats.summary()
    result["seconds"] = round(spec_s, 3)
    result["tokens_per_s"] = round(stats.generated_tokens / spec_s, 2) if spec_s else None
    result["lossless"] = None if not check_lossless else not mismatched
    if check_lossless:
        result["mismatched_prompts"] = sorted(mismatched)
        result["greedy_seconds"] = round(greedy_s, 3)
    return result
