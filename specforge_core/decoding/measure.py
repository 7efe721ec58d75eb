"""Measure a draft's acceptance by real speculative decoding over held-out prompts.

``measure_acceptance`` decodes the prompts with the target plus the draft (chain drafting,
greedy verification), ``batch_size`` prompts at a time, and pools the counts
(``decoding.acceptance``). With ``check_lossless`` it also decodes every prompt with the target alone
and compares the outputs token for token: speculation must never change the target's greedy
output. ``decode_in_batches`` is the batching both this and the benchmark table
(``decoding.benchmark``) decode with.
"""

import time
from collections.abc import Callable

from specforge_core.decoding.acceptance import AcceptanceStats
from specforge_core.decoding.speculative import Generation, decode_batch
from specforge_core.decoding.verifier import DecodingTarget


def decode_in_batches(target: DecodingTarget, prompts: list[list[int]], *, batch_size: int,
                      on_batch: Callable[[int], object] | None = None, **decode_kwargs) -> tuple[list[Generation], float]:
    """``decode_batch`` over ``prompts``, ``batch_size`` at a time, shortest first (less padding).

    Returns the generations in the order of ``prompts`` and the seconds spent decoding;
    ``on_batch(n)`` is called after each batch of ``n`` prompts. Batching only shares the weight
    reads: each prompt is decoded as if alone.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    gens: list[Generation | None] = [None] * len(prompts)
    seconds = 0.0
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        t0 = time.perf_counter()
        for i, gen in zip(chunk, decode_batch(target, [prompts[i] for i in chunk], **decode_kwargs)):
            gens[i] = gen
        seconds += time.perf_counter() - t0
        if on_batch is not None:
            on_batch(len(chunk))
    return gens, seconds


def measure_acceptance(model, drafter, prompts: list[list[int]], *, stop_ids: set[int], capture_layer_ids: list[int],
                       num_steps: int, max_new_tokens: int, batch_size: int = 8,
                       check_lossless: bool = False) -> dict:
    """Acceptance figures (``AcceptanceStats.summary``) plus timing and the losslessness check.

    ``model``: the HF target; ``drafter``: the draft family's decoding step
    (``family.drafter(draft)``, a ``decoding.speculative.Drafter``) on the same device; ``prompts``: token ids ending with the generation prompt.
    """
    target = DecodingTarget(model, capture_layer_ids)
    stats = AcceptanceStats(num_steps)
    common = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    try:
        gens, spec_s = decode_in_batches(target, prompts, drafter=drafter, num_steps=num_steps, **common)
        if check_lossless:
            plain, greedy_s = decode_in_batches(target, prompts, **common)
    finally:
        target.close()
    for gen in gens:
        stats.add(gen)
    result = stats.summary()
    result["seconds"] = round(spec_s, 3)
    result["tokens_per_s"] = round(stats.generated_tokens / spec_s, 2) if spec_s else None
    result["lossless"] = None
    if check_lossless:
        mismatched = [i for i, (g, p) in enumerate(zip(gens, plain)) if g.tokens != p.tokens]
        result["lossless"] = not mismatched
        result["mismatched_prompts"] = mismatched
        result["greedy_seconds"] = round(greedy_s, 3)
    return result
