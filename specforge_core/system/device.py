"""Which device and dtype a rank computes on: one rule for the trainer, the capture backends and the evaluator."""

import torch

from specforge_core.errors import ConfigError


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``capture.device`` → this rank's device (auto: the rank's GPU when CUDA is there, else CPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("capture.device=cuda but no CUDA device is visible", where="capture.device",
                              fix="set capture.device to auto or cpu, or run on a GPU node")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` → torch dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)
