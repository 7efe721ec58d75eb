"""Target capture: one protocol, two backends (``hf``, ``sglang``), built from the run config.

    backend = build_capture_backend(cfg, rank=rank, local_rank=local_rank, topology=plan.topology)
    batch = backend.capture(request)      # see capture/base.py for the CapturedBatch contract

Modules: ``base`` (request, batch, protocol), ``target_info`` (the target's config, capture
layers, run checks against it, head weights), ``hf`` (transformers + hooks), ``sglang_backend``
(backend over an injected engine, and its engine arguments: argv and kwargs views), ``sglang_engine`` (the one SGLang seam), ``packing`` and ``varlen`` (packed rows). The SGLang
stand-in for CPU tests is ``fixtures/fake_sglang.py``.
"""

from specforge_core.capture.base import CaptureBackend, CapturedBatch, TargetRequest
from specforge_core.run.topology import Topology

__all__ = ["CaptureBackend", "CapturedBatch", "TargetRequest", "build_capture_backend"]


def build_capture_backend(cfg, *, rank: int = 0, local_rank: int = 0, draft_config=None,
                          topology: Topology | None = None, target_config=None,
                          layer_ids: tuple[int, ...] | None = None, last_hidden: bool = True,
                          engine_factory=None) -> CaptureBackend:
    """Load the target for ``rank`` of ``topology`` (the run's; ``sglang`` needs it, ``hf`` reads
    none: every TP peer captures the whole TP-wide batch) and return its backend.

    ``target_config`` and ``layer_ids``: what the launch's preflight read and checked (the
    target's config; the target layers to capture, as the draft family resolved them). Without
    them the target's config is read here, the layers follow EAGLE3's rule
    (``target_info.resolve_capture_layers``), and the same target-dependent checks run first
    (:func:`~specforge_core.capture.target_info.validate_colocated`, capture-layer range);
    ``last_hidden``: keep the target's post-norm hidden (EAGLE3's teacher; DFlash needs none). For ``sglang``, ``engine_factory(args, layer_ids, place=,
    device=, islands=)`` builds the engine for this rank's place in its island (every rank at once): SGLang's
    ``ModelRunnerEngine.start`` by default, ``FakeSGLangEngine.start`` in CPU tests.
    """
    from specforge_core.capture.target_info import (
        load_target_config, resolve_capture_layers, text_config, validate_colocated,
    )
    from specforge_core.system.device import resolve_device, resolve_dtype

    device = resolve_device(cfg.capture.device, local_rank)
    checked = target_config is not None and layer_ids is not None
    if not checked:  # a caller without the launch's preflight
        target_config = target_config or load_target_config(cfg)
        validate_colocated(cfg, target_config)
    layer_ids = tuple(layer_ids) if layer_ids else resolve_capture_layers(cfg, target_config, draft_config)
    if cfg.capture.backend == "hf":
        from specforge_core.capture.hf import HFCaptureBackend

        return HFCaptureBackend.load(cfg, target_config, layer_ids, device=device, keep_last_hidden=last_hidden)

    from specforge_core.capture.sglang_backend import SGLangCaptureBackend, SGLangEngineArgs
    from specforge_core.capture.target_info import load_target_head

    if topology is None:
        raise ValueError("the sglang backend needs the run's topology: pass topology=")
    if not checked:
        from specforge_core.capture.sglang_backend import check_layer_ids

        check_layer_ids(layer_ids, text_config(target_config).num_hidden_layers)
    if engine_factory is None:
        from specforge_core.capture.sglang_engine import ModelRunnerEngine

        engine_factory = ModelRunnerEngine.start
    engine = engine_factory(SGLangEngineArgs.resolve(cfg, topology), layer_ids, place=topology.place(rank), device=device,
                            islands=topology.islands())
    embed, head = load_target_head(cfg.model.target, target_config, resolve_dtype(cfg.model.dtype, device), device)
    return SGLangCaptureBackend(engine, target_config, embed, head, keep_last_hidden=last_hidden)
