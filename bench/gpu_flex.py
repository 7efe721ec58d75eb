"""The draft's step-0 attention kernel alone: flex attention (forward + backward through its output
and its log-sum-exp, as the TTT merge uses it) under several compile settings, beside the flash
backend's kernels (``drafts/eagle3/flash.py``: variable-length FlashAttention on the unroll's
``[rows, heads, hd]`` layout, whose backward takes the log-sum-exp's gradient through the merged
output it is handed, so one backward through the output costs what the merge's needs), cuDNN's
causal kernel with its log-sum-exp (``cudnn``, kv heads expanded) and SDPA's causal kernel
(``sdpa``: whichever backend SDPA picks; ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``: that
one; no log-sum-exp: a bound on what a tuned kernel could reach), on one GPU.

    python3 bench/gpu_flex.py [--shapes 1x4096,4x2048] [--heads 32 --kv-heads 8 --head-dim 128]

Prints one row per variant and shape: forward + backward milliseconds, TFLOP/s (causal FLOPs) and
the ratio to the default. ``--out DIR`` writes ``DIR/flex.json``; with ``autotune`` among the
variants inductor's autotuning table goes to stderr (what config it chose).
"""

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: E402

from specforge_core.drafts.eagle3.attention import TTTAttention  # noqa: E402
from specforge_core.drafts.eagle3.flash import MergedOutput, SampleSpans, step_zero_flash  # noqa: E402

VARIANTS = ("default", "autotune", "flash", "cudnn", "sdpa")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}


def step_zero_mask(b, t, device):
    """The block mask the draft's attention builds for dense rows (one sample per row, all real)."""
    ones = torch.ones(b, t, dtype=torch.long, device=device)
    return TTTAttention(ones, torch.zeros_like(ones), "flex").block_mask


def make_fn(variant, b, t, heads, kv_heads, device):
    """``(run, layout)``: ``run(q, k, v)`` gives the scalar to differentiate; ``layout`` turns the
    ``[B, heads, T, hd]`` inputs into the ones ``run`` takes (outside the timing)."""
    dense = lambda x: x  # noqa: E731
    if variant == "sdpa" or variant in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[variant])]) if variant in SDPA_BACKENDS \
                    else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
            return out.float().sum()
        return run, dense
    if variant == "cudnn":  # cuDNN's kernel with its log-sum-exp; GQA as expanded heads
        def run(q, k, v):
            g = heads // kv_heads
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, True, 0.0, True, False)[0]
            return out.float().sum()
        return run, dense
    if variant == "flash":
        spans = SampleSpans(list(range(0, b * t + 1, t)))

        def run(q, k, v):
            out, _lse = step_zero_flash(q, k, v, spans, q.shape[-1] ** -0.5, MergedOutput())
            return out.float().sum()
        # the unroll's rows: [B·T, heads, hd]
        return run, lambda x: x.detach().transpose(1, 2).flatten(0, 1).contiguous().requires_grad_()
    mode = "max-autotune-no-cudagraphs" if variant == "autotune" else None
    flex = torch.compile(flex_attention, mode=mode)
    mask = step_zero_mask(b, t, device)

    def run(q, k, v):
        out, aux = flex(q, k, v, block_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=heads != kv_heads,
                        return_aux=AuxRequest(lse=True))
        return out.float().sum() + aux.lse.sum()  # gradients through both, as the merge needs
    return run, dense


def time_variant(fn, q, k, v, iters):
    for _ in range(3):
        fn(q, k, v).backward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(q, k, v).backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x4096,4x2048")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_flex.py needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for shape in a.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        torch.manual_seed(0)
        q = torch.randn(b, a.heads, t, a.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, a.kv_heads, t, a.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, a.kv_heads, t, a.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        flops = 3.5 * 4 * b * a.heads * t * t * a.head_dim / 2  # causal: forward 1, backward 2.5
        base = None
        for variant in a.variants.split(","):
            run, layout = make_fn(variant, b, t, a.heads, a.kv_heads, device)
            try:
                ms = time_variant(run, *(layout(x) for x in (q, k, v)), a.iters)
            except RuntimeError as e:  # a kernel that does not take these inputs: say so, go on
                print(f"{shape:>8} {variant:>10} failed: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            base = ms if base is None else base
            row = {"shape": shape, "variant": variant, "fwd_bwd_ms": round(ms, 3),
                   "tflops": round(flops / ms / 1e9, 1), "vs_first": round(base / ms, 3)}
            rows.append(row)
            print(f"{shape:>8} {variant:>10} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  ×{row['vs_first']:.2f}",
                  flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "flex.json"), "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
