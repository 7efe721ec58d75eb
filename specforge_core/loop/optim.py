"""FSDP2 over the draft, AdamW with fp32 master weights, global gradient clipping, accumulation.

The trainer hands over one ``root`` module whose ``forward`` runs the whole training step (the
objective over the draft). :func:`shard` makes all its trainable parameters one FSDP2 group:
the root's forward gathers them once, the objective then calls whatever draft methods it likes
(``project_hidden``, ``project_tokens``, ``compute_logits`` ...) on ordinary tensors, and
the gathered parameters stay until the end of backward (``reshard_after_forward=False``, like
FSDP1's SHARD_GRAD_OP): the TTT unroll uses the layer K times per micro-batch, and the draft is a
single layer, so finer groups would only add collectives.

Parameters are kept sharded in fp32: they are the master weights and AdamW's state is fp32 too.
With ``param_dtype=bfloat16`` a ``MixedPrecisionPolicy`` gathers them as bf16 for compute and
reduce-scatters gradients in fp32. Frozen parameters (the embedding copied from the target) are
not sharded: every rank keeps one copy in the compute dtype and FSDP never gathers it.
"""

from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import AdamW

from specforge_core.system.distributed import Dist
from specforge_core.loop.schedule import build_scheduler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard(root: nn.Module, d: Dist, *, param_dtype: Literal["float32", "bfloat16"] = "float32") -> FSDPModule:
    """Apply ``fully_shard`` to ``root`` over ``d.mesh``; returns it (now an ``FSDPModule``).

    Moves ``root`` to ``d.device`` and keeps trainable parameters in fp32 (master weights).
    Frozen parameters are cast to ``param_dtype`` and left unsharded on every rank. Buffers keep
    their dtype (RoPE tables stay fp32, the vocab map int64/bool).
    """
    compute = _DTYPES[param_dtype]
    root.to(d.device)
    frozen = {p for p in root.parameters() if not p.requires_grad}
    with torch.no_grad():
        for p in root.parameters():
            p.data = p.data.to(compute if p in frozen else torch.float32)
    kwargs = {}
    if compute != torch.float32:
        # The root's inputs are the captured batch: leave them in the precision the capture produced.
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    fully_shard(root, mesh=d.mesh, reshard_after_forward=False, ignored_params=frozen or None, **kwargs)
    return root  # type: ignore[return-value]


class DraftOptimizer:
    """AdamW + learning-rate schedule + clipping over a sharded root; whole optimizer steps only.

    Per micro-batch call :meth:`backward`; after exactly ``accumulation_steps`` of them call
    :meth:`step`. Gradients are reduce-scattered only on the last micro-batch of a window; the loss
    is divided by ``accumulation_steps`` so a window's gradient is the mean over its micro-batches.
    ``optimizer`` and ``scheduler`` are public for checkpointing. The schedule runs over
    ``total_steps``, or with ``lr_by_progress`` over the progress given by :meth:`set_progress`
    (a time budget: ``loop/schedule.py``). ``fused`` (default: when every parameter is on
    CUDA) picks the fused AdamW, which also applies the clipping inside its kernel.
    """

    def __init__(
        self,
        root: FSDPModule,
        *,
        learning_rate: float,
        weight_decay: float,
        max_grad_norm: float,
        accumulation_steps: int,
        total_steps: int,
        warmup_ratio: float,
        lr_scheduler: Literal["cosine", "constant"],
        lr_by_progress: bool = False,
        fused: bool | None = None,
    ):
        self.root = root
        self.params = [p for p in root.parameters() if p.requires_grad]  # type: ignore[attr-defined]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        # fused (the default on CUDA): one kernel per parameter group instead of a pass per AdamW
        # term, and the clipping's scale is applied inside it (``step``)
        self.fused = all(p.device.type == "cuda" for p in self.params) if fused is None else fused
        self.optimizer = AdamW(self.params, lr=learning_rate, weight_decay=weight_decay, fused=self.fused or None)
        self.scheduler = build_scheduler(
            self.optimizer, total_steps=total_steps, warmup_ratio=warmup_ratio, kind=lr_scheduler,
            by_progress=lr_by_progress,
        )
        self.micro_batches = 0  # in the current accumulation window

    def set_progress(self, progress: float) -> None:
        """A schedule by progress (``lr_by_progress``): the fraction of the run done. The next
        :meth:`step` still applies the rate set before; it then sets the following update's from this."""
        self.scheduler.lr_lambdas[0].progress = progress

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of one micro-batch's loss (synchronising on the window's last)."""
        if self.micro_batches >= self.accumulation_steps:
            raise RuntimeError(
                f"backward() after {self.micro_batches} micro-batches without step(): the window "
                f"holds accumulation_steps={self.accumulation_steps}"
            )
        last = self.micro_batches == self.accumulation_steps - 1
        self.root.set_requires_gradient_sync(last)
        (loss / self.accumulation_steps).backward()
        self.micro_batches += 1

    def step(self, grad_scale: float | torch.Tensor | None = None) -> dict[str, float]:
        """Clip to ``max_grad_norm`` (global norm over all shards), update, advance the schedule.

        ``grad_scale`` (a number, or a scalar tensor on the device that the host never reads)
        multiplies every gradient first (objectives whose loss is a sum, normalised by a global
        count only known after the window: see ``Trainer``). Returns the pre-clip
        ``grad_norm`` (a 0-dim tensor on the device: reading it waits for the step, so the caller
        reads it when it logs) and the ``lr`` this update used. Raises RuntimeError unless the window is
        complete: a partial accumulation window never updates the weights.
        """
        if self.micro_batches != self.accumulation_steps:
            raise RuntimeError(
                f"step() after {self.micro_batches} of accumulation_steps={self.accumulation_steps} "
                "micro-batches: only whole optimizer steps are trained"
            )
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = self._global_norm(grads)
        if grad_scale is not None:
            norm = norm * grad_scale
        # clip_grad_norm_'s coefficient, kept on the device: min(1, max / (norm + 1e-6))
        multiplier = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        if grad_scale is not None:
            multiplier = multiplier * grad_scale
        lr = self.scheduler.get_last_lr()[0]
        if self.fused and all(p in self.optimizer.state for p in self.params if p.grad is not None):
            # the fused kernel divides each gradient by ``grad_scale`` as it reads it: no extra pass
            self._fused_step_on_shards(multiplier.reciprocal())
        elif self.fused:  # a first update makes AdamW's state (as DTensors, like the parameters)
            self.optimizer.grad_scale = multiplier.reciprocal()
            self.optimizer.step()
            del self.optimizer.grad_scale
        else:
            torch._foreach_mul_(grads, multiplier)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.micro_batches = 0
        return {"grad_norm": norm.detach(), "lr": float(lr)}

    @torch.no_grad()
    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of all gradients over every rank's shards (a 0-dim fp32 tensor on the
        device). Gradients sharded over one mesh dimension (FSDP2's) are read through their local
        shards, whose squares' sum is all-reduced over the mesh once; others (replicated, or
        meshes of more dimensions) go through DTensor as ``get_total_norm`` takes them."""
        sharded = [g for g in grads if isinstance(g, DTensor)]
        meshes = {id(g.device_mesh) for g in sharded}
        if len(meshes) > 1 or any(g.device_mesh.ndim != 1 or not g.placements[0].is_shard() for g in sharded):
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()

        def squares(tensors):
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)).float()) ** 2

        total = squares([g.to_local() for g in sharded]) if sharded else None
        if sharded and sharded[0].device_mesh.size() > 1:
            torch.distributed.all_reduce(total, group=sharded[0].device_mesh.get_group())
        plain = [g for g in grads if not isinstance(g, DTensor)]
        if plain:
            total = squares(plain) if total is None else total + squares(plain)
        return total.sqrt()

    @torch.no_grad()
    def _fused_step_on_shards(self, grad_scale: torch.Tensor) -> None:
        """AdamW's fused update, as ``optimizer.step()`` makes it, on the local shards of the
        parameters, gradients and state: the same tensors' storage, without DTensor's dispatch of
        every list op. The optimizer's ``state`` and ``param_groups`` stay the public record
        (checkpoints map them to parameter names)."""
        from torch.optim.adam import adam

        for group in self.optimizer.param_groups:
            owned = [p for p in group["params"] if p.grad is not None]
            if not owned:
                continue
            state = [self.optimizer.state[p] for p in owned]
            beta1, beta2 = group["betas"]
            adam([_local(p) for p in owned], [_local(p.grad) for p in owned],
                 [_local(s["exp_avg"]) for s in state], [_local(s["exp_avg_sq"]) for s in state], [],
                 [s["step"] for s in state], fused=True, grad_scale=grad_scale, decoupled_weight_decay=True,
                 amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group["maximize"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage, outside autograd: call under no_grad); any
    other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
