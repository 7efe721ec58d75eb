"""``torch.compile`` where it pays in the training step, and where its caches live.

    from specforge_core.system.compile import build_block_mask, compile_pointwise, compile_target, fused, compile_cache
    compile_target(target.model)         # the hf backend does this with training.compile on CUDA
    compile_pointwise(draft)             # python -m specforge_core.train does this likewise
    loss = fused(fn, logits.device, compile)(logits, ...)   # the EAGLE3 unroll's memory-bound passes
    with compile_cache(run_dir / "compile-cache"): ...   # train.py: a resumed run reuses the graphs
    mask = build_block_mask(mask_mod, compiled=q.is_cuda, B=b, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=d)

Three kinds of code are compiled, all only with ``training.compile`` on CUDA (the EAGLE3 objective
hands it to each :func:`fused` call as an argument; flex attention, the EAGLE3 draft's attention in fp32 and DFlash's, is
compiled always, it has no fast eager path, and so is the building of its block masks, whose eager
form materialises the dense mask):

- the target's decoder layers, each as one region (:func:`compile_target`: RoPE, the residual
  adds and norms, the MLP's SiLU × up fused around the matmuls and the packed attention);
- every other ``*RMSNorm`` (fp32 cast, variance, rsqrt, scale) and ``*MLP`` (SiLU × up) module: several
  passes over the activations in eager mode, one fused kernel around the matmuls compiled; the
  EAGLE3 draft's decoder layer instead as two regions (``compiled_regions``: the hidden norm,
  q/k/v's hidden half added to the step's rows of the embedding half, RoPE; o_proj, residuals,
  norm, MLP), whose dozens of small launches per unrolled step the host otherwise issues one by
  one while the device waits; their inputs' row counts symbolic, every other size constant;
- :func:`fused` functions: the unroll's passes over ``[N, Vd]`` logits (soft CE, overlap, their
  backward), the teacher's per-chunk statistics and the same-position merge, a few fp32
  element-wise operations each that read their inputs once and gather as they read; compiled
  with the row counts symbolic and the model's sizes constant (:func:`rows_dynamic`).

Without ``training.compile`` a run compiles nothing but flex attention and its block masks where it
uses them; with it the first step waits for the compile, whose graphs are cached in the run
directory (:func:`compile_cache`) for a resumed run (a flow run's: in the run directories' parent,
for every later flow run too: run/directory.shared_compile_cache), and the steps after it are
faster. Start time and tokens/s either way: docs/performance.md, "Cold start and
``training.compile``".
"""

import contextlib
import os
import warnings
from pathlib import Path

import torch
from torch import nn

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_COMPILED: dict = {}


def fused(fn, device: torch.device, enabled: bool):
    """``fn`` compiled (once per function, :func:`rows_dynamic`) when ``enabled`` (the caller's
    ``training.compile``) and ``device`` is CUDA, else ``fn`` itself. No state: two objectives of
    one process may differ."""
    if not enabled or torch.device(device).type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = rows_dynamic(torch.compile(fn, dynamic=True))
    return _COMPILED[fn]


def rows_dynamic(compiled, *, matrix_rows: bool = True):
    """``compiled`` (a ``torch.compile(..., dynamic=True)`` function of rows) called with only
    its inputs' row counts symbolic.

    The compiled functions take tensors (also in lists) that hold rows, whose count changes every
    step: in dim 1 of a tensor of three or more dims (the unroll's ``[1, n, heads, ...]``), and,
    with ``matrix_rows`` (the fused functions' ``[n, Vd]`` logits, ``[n]`` labels), in dim 0 of
    a 1-D or 2-D one; without it (the layer's regions) a 1-D or 2-D input is a weight, every dim
    static. Every dim after the rows is a size of the model (vocabulary, heads, head size),
    marked static (``torch._dynamo.mark_static``) so the kernels index with constants; no dim up
    to the rows is ever marked. A symbolic model size makes the generated kernels divide every
    element's flat index by a runtime integer (the soft CE's backward by the vocabulary size, the
    RoPE backward of the layer's q/k/v region by the head size and head counts), which keeps
    them from vectorising their loads: the static sizes are what lets them run at the memory's
    bandwidth."""
    lowest = 1 if matrix_rows else 0
    return _with_static_dims(compiled, lambda x: range(lowest if x.dim() <= 2 else 2, x.dim()))


def _with_static_dims(compiled, static_dims):
    """``compiled`` called with the dims ``static_dims(x)`` of each tensor input ``x`` (also in
    lists and tuples) marked static (``torch._dynamo.mark_static``)."""

    def run(*args, **kwargs):
        for arg in (*args, *kwargs.values()):
            for x in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(x, torch.Tensor):
                    for d in static_dims(x):
                        torch._dynamo.mark_static(x, d)
        return compiled(*args, **kwargs)

    return run


def compile_target(decoder: nn.Module, **options) -> int:
    """``training.compile`` for the target the ``hf`` backend captures from (a transformers decoder
    with a ``layers`` list): each decoder layer's ``forward`` as one region, then
    :func:`compile_pointwise` for what lies outside the layers (the final norm). Returns how many
    were compiled; ``options`` go to ``torch.compile`` (a test's backend).

    One region per layer fuses what per-module compiling leaves eager: RoPE on q and k with their
    ``[N, heads, hd]`` layout for the attention, and each residual add with the norm after it
    (the packed attention is one opaque op, ``capture.varlen.varlen_attention``). All layers share
    one graph (their parameters are graph inputs). Floating inputs keep their last dim (hidden
    size, head size) constant; every other size is symbolic, so changing token and sample counts
    (positions, the samples' cumulative lengths) reuse the graph. Forward hooks on the layers
    (the capture's) run outside the region."""
    layers = list(getattr(decoder, "layers", ()))
    for layer in layers:
        layer.forward = _with_static_dims(torch.compile(layer.forward, dynamic=True, **options), _last_dim_static)
    return len(layers) + compile_pointwise(decoder, skip=layers)


def _last_dim_static(x: torch.Tensor) -> tuple:
    """:func:`compile_target`'s static dims: the last of a floating tensor of two or more dims."""
    return (x.dim() - 1,) if x.is_floating_point() and x.dim() >= 2 else ()


def compile_pointwise(root: nn.Module, *, skip=()) -> int:
    """``torch.compile(dynamic=True)`` every ``*RMSNorm`` and ``*MLP`` module under ``root``, and
    each method a module's class names in ``compiled_regions`` (one region each: its norms, MLP,
    projections and the element-wise work between them in one graph; modules under it are left
    to it).

    Returns how many were compiled; modules in ``skip`` and under them are left alone. Modules of one class share one compiled graph (their
    parameters are graph inputs, their sizes static); ``dynamic=True`` because token counts
    change every step. A region's other inputs have only their rows symbolic
    (:func:`rows_dynamic` without ``matrix_rows``: a 2-D input, such as the q/k/v weight the
    training step folds once, is all static). Forward and backward both use the compiled kernels.
    """
    count = 0
    covered = {id(m) for top in skip for m in top.modules()}
    for module in root.modules():
        if id(module) in covered:
            continue
        regions = getattr(type(module), "compiled_regions", ())
        if regions:
            for method in regions:
                compiled = torch.compile(getattr(module, method), dynamic=True)
                setattr(module, method, rows_dynamic(compiled, matrix_rows=False))
            covered.update(id(m) for m in module.modules())
            count += len(regions)
            continue
        name = type(module).__name__
        if name.endswith("RMSNorm") or name.endswith("MLP"):
            module.compile(dynamic=True)
            count += 1
    return count


@contextlib.contextmanager
def compile_cache(path: str | Path):
    """Keep torch.compile's on-disk caches (inductor's FX graphs, AOTAutograd graphs, Triton
    kernels) under ``path`` while the block runs, unless ``TORCHINDUCTOR_CACHE_DIR`` is already
    set (the user's choice wins). A resumed run in the same directory then loads what the first
    one compiled instead of compiling again. Nothing is created until something compiles."""
    if os.environ.get(CACHE_ENV):
        yield Path(os.environ[CACHE_ENV])
        return
    os.environ[CACHE_ENV] = str(Path(path).resolve())
    try:
        yield Path(os.environ[CACHE_ENV])
    finally:
        os.environ.pop(CACHE_ENV, None)


_EAGER_MASKS: set[str] = set()  # devices whose compiled mask build failed in this process
_compiled_mask_builder = None


def build_block_mask(mask_mod, *, compiled: bool, **sizes):
    """flex's block mask of ``mask_mod`` (``sizes``: ``create_block_mask``'s B, H, Q_LEN, KV_LEN,
    device, BLOCK_SIZE). ``compiled`` (the CUDA default): inductor evaluates the predicate tile by tile and
    no dense ``[Q, KV]`` grid exists; eager evaluation materialises that grid and an int64 copy.
    Where the compiled build fails (what inductor accepts differs between torch versions) the
    eager build makes the same mask: a warning says so, and this process builds eagerly on that
    device from then on."""
    global _compiled_mask_builder
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(sizes["device"]).type
    if compiled and device not in _EAGER_MASKS:
        if _compiled_mask_builder is None:
            _compiled_mask_builder = torch.compile(create_block_mask)
        try:
            return _compiled_mask_builder(mask_mod, **sizes)
        except Exception as failed:  # noqa: BLE001  (torch.compile raises many kinds)
            _EAGER_MASKS.add(device)
            warnings.warn(f"the compiled flex block mask build failed ({type(failed).__name__}: "
                          f"{str(failed).splitlines()[0][:200]}); building masks eagerly, which costs "
                          "memory for a dense [Q, KV] grid", RuntimeWarning, stacklevel=2)
    return create_block_mask(mask_mod, **sizes)
