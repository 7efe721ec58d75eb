"""A stand-in for SGLang's in-process capture engine, for CPU tests and the tiny demo.

    engine = FakeSGLangEngine.start(SGLangEngineArgs.resolve(cfg), layer_ids, tp_rank=1, device=cpu)

It honours the :class:`~specforge_core.capture.sglang.CaptureEngine` contract the way a real
TP group does: every TP peer computes the whole TP-wide batch (standing in for the sharded forward
the TP group runs together), lays every row's states out token-packed in **one** TP-wide buffer
(SGLang's extend output has that shape), and returns views of this rank's rows into that buffer —
so a backend that forgot to copy would keep the whole TP-wide buffer alive.

The math is transformers' own, taken independently of the ``hf`` backend: ``aux`` from
``output_hidden_states[i+1]`` (SGLang's "input of layer i+1" convention, which equals the output
of layer i), ``last`` from the decoder's post-norm output. ``forward_calls``, ``rows_computed``
and ``tokens_computed`` count the work done, for tests that assert by counting.
"""

from collections.abc import Sequence

import torch

from specforge_core.capture.base import attention_mask_for, pad_right
from specforge_core.capture.sglang import PackedCapture


class FakeSGLangEngine:
    """CPU engine with the SGLang capture contract; see the module docstring."""

    def __init__(self, model_dir: str, layer_ids: Sequence[int], *, tp_rank: int = 0, tp_size: int = 1,
                 device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        self._decoder = model.eval().requires_grad_(False).get_decoder()
        self.layer_ids = tuple(layer_ids)
        if max(self.layer_ids) + 1 >= model.config.num_hidden_layers:
            raise ValueError("the fake engine captures layer inputs, so ids must be below N-1")
        self.tp_rank, self.tp_size, self.device = tp_rank, tp_size, device
        self.forward_calls = self.rows_computed = self.tokens_computed = 0
        self.closed = False

    @classmethod
    def start(cls, args, layer_ids: Sequence[int], *, tp_rank: int, device: torch.device) -> "FakeSGLangEngine":
        """Same signature as ``ModelRunnerEngine.start``: build from resolved engine arguments."""
        dtype = torch.float32 if args.get("dtype") in ("auto", "float32") else getattr(torch, args.get("dtype"))
        return cls(args.get("model_path"), layer_ids, tp_rank=tp_rank, tp_size=args.get("tp_size"),
                   device=device, dtype=dtype)

    def capture(self, input_ids: Sequence[Sequence[int]], local: slice) -> PackedCapture:
        if self.closed:
            raise RuntimeError("engine is shut down")
        lengths = [len(r) for r in input_ids]
        width = max(lengths)
        with torch.inference_mode():
            out = self._decoder(
                input_ids=pad_right(input_ids, self.device, width),
                attention_mask=attention_mask_for(lengths, width, self.device),
                use_cache=False,
                output_hidden_states=True,
            )
            aux = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
            real = attention_mask_for(lengths, width, self.device).bool()
            tp_aux, tp_last = aux[real], out.last_hidden_state[real]  # the TP-wide packed buffer
        self.forward_calls += 1
        self.rows_computed += len(lengths)
        self.tokens_computed += sum(lengths)
        start = sum(lengths[: local.start])
        stop = start + sum(lengths[local])
        return PackedCapture(aux=tp_aux[start:stop], last=tp_last[start:stop], lengths=lengths[local])

    def shutdown(self) -> None:
        self.closed = True
