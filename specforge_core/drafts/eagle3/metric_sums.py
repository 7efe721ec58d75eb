"""EAGLE3 training metrics as summable sums, and the ratios derived from them (reference §2.4).

Every rank returns the same keys with float64 tensors that are *sums* (numerators and
denominators), so data-parallel ranks combine them with one ``all_reduce(SUM)``; ratios are taken
only after the reduction:

    sums = all_reduce_metric_sums(sums)            # or sum the dicts of several micro-batches
    summarize_metrics(sums, decay=0.8)

Keys of the sums (``[K]`` per unrolled step unless noted):
``loss_sum`` (Σ pm·CE), ``acc_correct``/``acc_total`` (d2t-mapped draft argmax == target argmax,
over the valid loss mask), ``accept_sum``/``accept_total`` (Σ pm·Σ_v min(p_target, q_draft),
over pm), ``positions`` (scalar: B·T, the loss denominator).
"""

import torch

SUM_KEYS = ("loss_sum", "acc_correct", "acc_total", "accept_sum", "accept_total")


def metric_sums(steps, positions: int) -> dict[str, torch.Tensor]:
    """Sum the per-position step terms (``objective.StepTerms``) into the summable metric dict."""
    def stacked(attr):
        return torch.stack([getattr(s, attr).detach().sum() for s in steps]).double()

    sums = {
        "loss_sum": stacked("loss"),
        "acc_correct": stacked("correct"),
        "acc_total": stacked("valid"),
        "accept_sum": stacked("accept"),
        "accept_total": stacked("in_draft"),
    }
    # a fill, not a copy of a host scalar: a copy from pageable memory would wait for the device
    sums["positions"] = torch.full((), float(positions), dtype=torch.float64, device=sums["loss_sum"].device)
    return sums


def add_metric_sums(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Elementwise sum of two metric dicts (``a`` may be None), e.g. over accumulation micro-steps."""
    return dict(b) if a is None else {k: a[k] + b[k] for k in b}


def all_reduce_metric_sums(sums: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Sum the metric dict over the ranks of ``group`` with a single all_reduce (no-op unless
    torch.distributed is initialised). Returns a new dict."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(sums)
    keys = sorted(sums)
    flat = torch.cat([sums[k].reshape(-1) for k in keys])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, offset = {}, 0
    for k in keys:
        n = sums[k].numel()
        out[k] = flat[offset : offset + n].reshape(sums[k].shape)
        offset += n
    return out


def summarize_metrics(sums: dict[str, torch.Tensor], decay: float = 0.8) -> dict[str, float]:
    """Ratios from (reduced) sums.

    ``acc_k``, ``acceptance_rate_k``, ``ploss_k`` (= L_k), ``loss`` (Σ decay^k ploss_k), ``acc``
    (pooled over steps), ``acceptance_rate`` (mean over steps),
    ``simulated_accept_length`` = Σ_k Π_{j≤k} acc_j (chain of top-1 matches, no bonus token, as
    SpecForge reports it) and ``simulated_accept_length_with_bonus`` = 1 + that (tokens per target
    verify step, comparable to serving's accept length). An empty denominator gives 0.
    """
    s = {k: v.detach().double().cpu() for k, v in sums.items()}
    steps = s["loss_sum"].numel()
    positions = float(s["positions"])

    def ratio(num, den):
        return [float(n / d) if d > 0 else 0.0 for n, d in zip(num.tolist(), den.tolist())]

    acc = ratio(s["acc_correct"], s["acc_total"])
    accept = ratio(s["accept_sum"], s["accept_total"])
    ploss = [float(x) / positions if positions > 0 else 0.0 for x in s["loss_sum"].tolist()]
    out: dict[str, float] = {}
    for k in range(steps):
        out[f"acc_{k}"] = acc[k]
        out[f"acceptance_rate_{k}"] = accept[k]
        out[f"ploss_{k}"] = ploss[k]
    out["loss"] = sum(decay**k * ploss[k] for k in range(steps))
    total = float(s["acc_total"].sum())
    out["acc"] = float(s["acc_correct"].sum()) / total if total > 0 else 0.0
    out["acceptance_rate"] = sum(accept) / steps
    chain, length = 1.0, 0.0
    for a in acc:
        chain *= a
        length += chain
    out["simulated_accept_length"] = length
    out["simulated_accept_length_with_bonus"] = 1.0 + length
    return out
