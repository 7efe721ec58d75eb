"""Target capture: one protocol, two backends (``hf``, ``sglang``), built from the run config.

    backend = build_capture_backend(cfg, rank=rank, local_rank=local_rank)
    batch = backend.capture(request)      # see capture/base.py for the CapturedBatch contract

Modules: ``base`` (request, batch, protocol), ``target`` (capture layers, run checks against the
target's config, head weights), ``hf`` (transformers + hooks), ``sglang`` (backend over an
injected engine), ``sglang_args`` (engine arguments: argv and kwargs views), ``sglang_engine``
(the one SGLang seam), ``fake_engine`` (SGLang stand-in for CPU tests).
"""

from specforge_core.capture.base import CaptureBackend, CapturedBatch, TargetRequest

__all__ = ["CaptureBackend", "CapturedBatch", "TargetRequest", "build_capture_backend"]


def build_capture_backend(cfg, *, rank: int = 0, local_rank: int = 0, draft_config=None,
                          engine_factory=None) -> CaptureBackend:
    """Load the target for this rank and return its capture backend.

    Runs the target-dependent checks first (:func:`~specforge_core.capture.target_info.validate_colocated`,
    capture-layer range). For ``sglang``, ``engine_factory(args, layer_ids, tp_rank=, device=)``
    builds the engine: SGLang's ``ModelRunnerEngine.start`` by default, ``FakeSGLangEngine.start``
    in CPU tests.
    """
    from specforge_core.runtime.device import resolve_device

    device = resolve_device(cfg.capture.device, local_rank)
    if cfg.capture.backend == "hf":
        from specforge_core.capture.hf import HFCaptureBackend

        return HFCaptureBackend.from_config(cfg, device=device, draft_config=draft_config)

    from transformers import AutoConfig

    from specforge_core.capture.sglang_backend import SGLangCaptureBackend
    from specforge_core.capture.sglang_args import SGLangEngineArgs
    from specforge_core.capture.target_info import load_target_head, resolve_capture_layers, validate_colocated
    from specforge_core.runtime.device import resolve_dtype

    target_config = AutoConfig.from_pretrained(cfg.model.target, trust_remote_code=cfg.model.trust_remote_code)
    validate_colocated(cfg, target_config)
    layer_ids = resolve_capture_layers(cfg, target_config, draft_config)
    if engine_factory is None:
        from specforge_core.capture.sglang_engine import ModelRunnerEngine

        engine_factory = ModelRunnerEngine.start
    args = SGLangEngineArgs.resolve(cfg)
    engine = engine_factory(args, layer_ids, tp_rank=rank % cfg.training.tp_size, device=device)
    embed, head = load_target_head(cfg.model.target, target_config, resolve_dtype(cfg.model.dtype, device), device)
    return SGLangCaptureBackend(engine, target_config, embed, head)
