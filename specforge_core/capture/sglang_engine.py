"""The ONE SGLang seam: every SGLang import in this project lives in this module.

    engine = ModelRunnerEngine.start(SGLangEngineArgs.resolve(cfg), layer_ids, tp_rank=r, device=dev)

Pinned to ``sglang==0.5.23`` (:data:`SGLANG_VERSION`; :func:`require_sglang` refuses any other).
SGLang's internal APIs (``ModelRunner``, ``ScheduleBatch``, ``ForwardBatch``) change between minor
versions, so bumping the pin means re-reading them and re-testing this file on a GPU node; nothing
else in the project changes. A test scans the package and fails if ``sglang`` is imported anywhere
else. CPU tests drive the sglang backend through ``fake_engine.FakeSGLangEngine``, which honours
the same :class:`~specforge_core.capture.sglang_backend.CaptureEngine` contract.

Why drive ``ModelRunner`` and not ``sglang.Engine``: the engine's public path
(``enable_return_aux_hidden_states`` + ``return_aux_hidden_state_layer_ids`` with
``generate(..., return_hidden_states=True)``) returns the aux states as Python lists and never the
final post-norm hidden the teacher needs. So, as SpecForge's offline capture does (specforge-facts
§3.4), we build a ``ModelRunner`` ourselves, mark the capture layers with
``set_eagle3_layers_to_capture`` (SGLang stores ``id+1`` and captures the input of that layer =
the output of layer ``id``), replace the model's logits processor so the LM head never runs and
the post-norm hidden of every token is returned, and run one extend forward per TP-wide batch.

TP: run under torchrun with ``torch.distributed`` already initialised; SGLang forms its TP groups
from consecutive ranks, which is exactly our island (``rank // tp_size``). Every TP peer calls
:meth:`ModelRunnerEngine.capture` with the same rows; the residual stream is replicated across
the TP group, so each rank cuts its own rows out of the packed output.

Status: written against SGLang 0.5.23's internals as documented; it cannot run on the CPU
machines or the offline GPU box (no SGLang there). Verify on a GPU node with SGLang installed
by comparing one batch against the ``hf`` backend (tests/capture/test_sglang_backend.py shows
the comparison the fake passes).
"""

from collections.abc import Sequence

import torch

from specforge_core.capture.sglang_backend import PackedCapture
from specforge_core.errors import CaptureError

SGLANG_VERSION = "0.5.23"


def require_sglang():
    """Import sglang and check it is the pinned version; raise CaptureError saying what to do."""
    try:
        import sglang
    except ImportError:
        raise CaptureError(
            "sglang is not installed in this environment",
            where="capture.backend=sglang",
            fix=f"pip install sglang=={SGLANG_VERSION} on the GPU nodes, or set capture.backend=hf",
        ) from None
    if sglang.__version__ != SGLANG_VERSION:
        raise CaptureError(
            f"sglang {sglang.__version__} is installed; the capture seam is written for {SGLANG_VERSION}",
            where="specforge_core/capture/sglang_engine.py",
            fix=f"pip install sglang=={SGLANG_VERSION}",
        )
    return sglang


class _HiddenStatesOnly(torch.nn.Module):
    """Replaces the model's logits processor: no LM head, every token's post-norm hidden + aux."""

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        return LogitsProcessorOutput(
            next_token_logits=None,
            hidden_states=(hidden_states, torch.cat(aux_hidden_states, dim=-1)),
        )


class ModelRunnerEngine:
    """SGLang ``ModelRunner`` driven directly, one TP-wide extend per :meth:`capture`."""

    def __init__(self, runner, layer_ids: Sequence[int], tp_rank: int, tp_size: int, device: torch.device):
        self.runner, self.layer_ids = runner, tuple(layer_ids)
        self.tp_rank, self.tp_size, self.device = tp_rank, tp_size, device

    @classmethod
    def start(cls, args, layer_ids: Sequence[int], *, place, device: torch.device) -> "ModelRunnerEngine":
        require_sglang()
        tp_rank = place.tp_rank
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs(**args.kwargs())
        tp, ep = server_args.tp_size, server_args.ep_size
        runner = ModelRunner(
            model_config=ModelConfig.from_server_args(server_args),
            mem_fraction_static=server_args.mem_fraction_static,
            gpu_id=device.index,
            tp_rank=tp_rank,
            tp_size=tp,
            moe_ep_rank=tp_rank // (tp // ep),
            moe_ep_size=ep,
            pp_rank=0,
            pp_size=1,
            nccl_port=0,  # unused: torch.distributed is already initialised by torchrun
            server_args=server_args,
        )
        runner.model.set_eagle3_layers_to_capture(list(layer_ids))
        runner.model.logits_processor = _HiddenStatesOnly()
        return cls(runner, layer_ids, tp_rank, tp, device)

    def _tree_cache(self):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        r = self.runner
        return RadixCache(CacheInitParams(
            disable=True,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
            page_size=r.server_args.page_size,
        ))

    def capture(self, input_ids: Sequence[Sequence[int]], local: slice) -> PackedCapture:
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        r = self.runner
        reqs = []
        for i, ids in enumerate(input_ids):
            req = Req(rid=f"capture-{i}", origin_input_text="", origin_input_ids=list(ids),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1, top_k=1))
            req.fill_ids = list(ids)
            req.extend_input_len = len(ids)
            req.logprob_start_len = len(ids) - 1
            reqs.append(req)
        try:
            batch = ScheduleBatch.init_new(
                reqs=reqs,
                req_to_token_pool=r.req_to_token_pool,
                token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
                tree_cache=self._tree_cache(),
                model_config=r.model_config,
                enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE,
            )
            batch.prepare_for_extend()
            batch.capture_hidden_mode = CaptureHiddenMode.FULL
            forward_batch = ForwardBatch.init_new(batch.get_model_worker_batch(), r)
            forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
            with torch.inference_mode():
                last, aux = r.forward(forward_batch).logits_output.hidden_states
        finally:
            # Nothing is kept between batches: every request's KV slots go back to the pools.
            r.req_to_token_pool.clear()
            r.token_to_kv_pool_allocator.clear()
        lengths = [len(ids) for ids in input_ids]
        start = sum(lengths[: local.start])
        stop = start + sum(lengths[local])
        return PackedCapture(aux=aux[start:stop], last=last[start:stop], lengths=lengths[local])

    def shutdown(self) -> None:
        self.runner = None
        torch.cuda.empty_cache()
