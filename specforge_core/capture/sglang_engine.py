"""The ONE SGLang seam: every SGLang import in this project lives in this module.

    engine = ModelRunnerEngine.start(SGLangEngineArgs.resolve(cfg, topology), layer_ids,
                                     place=topology.place(rank), device=dev, islands=topology.islands())
    packed = engine.capture(rows, local)        # every TP peer of the island, same rows, same time

Pinned to ``sglang==0.5.14`` (:data:`SGLANG_VERSION`; the torch 2.11 line SpecForge 0.2.0 pins
too): :func:`require_sglang` refuses any other version without importing SGLang (importing it
patches transformers process-wide). SGLang's internal APIs (``ModelRunner``, ``ScheduleBatch``,
``ForwardBatch``, ``parallel_state``) change between minor versions: ``tests/capture/
test_sglang_contract.py`` parses the pinned wheel's source and checks every name, signature and
field used here, and fails when the pin moves without this file being re-read.

Why ``ModelRunner`` and not ``sglang.Engine``: 0.5.14's engine returns only the final hidden
state. So this drives one ``ModelRunner`` per rank:

1. **Islands inside a larger world.** ``ModelRunner.__init__`` calls SGLang's
   ``init_distributed_environment`` and ``initialize_model_parallel`` by name; the second refuses a
   torch world larger than tp × pp. While the runner is built, both names are replaced
   (:func:`_island_groups`): SGLang's "world" group becomes this rank's island, its TP group the
   island's consecutive ranks, and the PP / attention-CP / MoE-DP / MoE-EP groups one-rank groups,
   i.e. exactly the groups SGLang builds for world == tp, repeated per island. Group creation is
   collective over the whole torchrun world: every rank starts its engine at the same point.
2. **The calls ``__init__`` leaves to the caller**, in the scheduler's order: ``alloc_memory_pool``,
   ``init_attention_backends``, ``init_cuda_graphs`` (this one also builds the eager runner every
   eager forward goes through). Then the pools' real sizes are checked against the batch.
3. **Capture.** ``set_eagle3_layers_to_capture(ids)`` makes the model keep the residual stream
   entering layer ``id+1`` (= the output of layer ``id``); the model's logits processor is replaced
   by :class:`_CaptureHead`, which runs no LM head and returns every token's post-norm hidden and
   the aux list.
4. **One extend per batch**: ``Req`` per row (token ids as ``array('q')``), ``ScheduleBatch.init_new``
   with a stateless ``ChunkCache``, ``prepare_for_extend``, the staged CPU ids moved to the GPU,
   ``ForwardBatch.init_new(batch, runner)``, ``runner.forward``; afterwards the request and KV pools
   are cleared, so nothing outlives a batch.

The residual stream is replicated across the TP group, so each peer cuts its own rows out of the
packed output. Status, a GPU check: ``bench/gpu_sglang_check.py`` (docs/performance.md).
"""

import contextlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specforge_core.capture.sglang_backend import (
    PackedCapture, check_engine_pools, check_engine_request, check_lockstep,
)
from specforge_core.errors import CaptureError

SGLANG_VERSION = "0.5.14"


def require_sglang(where: str = "capture.backend=sglang", instead: str = "set capture.backend=hf") -> None:
    """Check the installed SGLang is the pinned version, without importing it; CaptureError says
    what to do (``where`` the option that asked for SGLang, ``instead`` the way around it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        raise CaptureError(
            "sglang is not installed in this environment",
            where=where,
            fix=f"pip install -e '.[sglang]' (sglang=={SGLANG_VERSION}) on the GPU nodes, or {instead}",
        ) from None
    if found != SGLANG_VERSION:
        raise CaptureError(
            f"sglang {found} is installed; the capture seam is written for {SGLANG_VERSION}",
            where=f"{where} (specforge_core/capture/sglang_engine.py)",
            fix=f"pip install sglang=={SGLANG_VERSION} (the [sglang] extra), or {instead}",
        )


def start_generation_engine(**kwargs):
    """``sglang.Engine(**kwargs)``, the pinned version checked first: the generating engine
    ``regenerate --engine sglang`` answers with (``decoding/answering.py`` states its contract)."""
    require_sglang(where="--engine sglang", instead="use --engine hf")
    import sglang

    return sglang.Engine(**kwargs)


@contextlib.contextmanager
def _island_groups(islands: list[list[int]]):
    """Replace the two group builders ``ModelRunner.init_torch_distributed`` calls by name, so that
    SGLang's process groups are this rank's island inside the torchrun world."""
    import sglang.srt.model_executor.model_runner as runner_module
    from sglang.srt.distributed import parallel_state as ps

    world = sum(len(g) for g in islands)

    def init_distributed_environment(*, backend, local_rank, **_):
        if not torch.distributed.is_initialized():
            raise CaptureError("torch.distributed is not initialised", where="sglang engine",
                               fix="start the run with torchrun (or python -m specforge_core.train)")
        if ps._WORLD is not None:
            raise CaptureError("an SGLang engine already runs in this process", where="sglang engine",
                               fix="one capture engine per rank process")
        # init_world_group's flags, with every island listed: new_group is collective over the world
        ps._WORLD = ps.GroupCoordinator(
            group_ranks=islands, local_rank=local_rank, torch_distributed_backend=backend,
            use_pynccl=False, use_pymscclpp=False, use_custom_allreduce=False,
            use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
            use_xpu_communicator=False, use_npu_communicator=False, group_name="world",
        )

    def initialize_model_parallel(*, tensor_model_parallel_size, pipeline_model_parallel_size=1,
                                  expert_model_parallel_size=1, attention_data_parallel_size=1,
                                  attention_context_model_parallel_size=1, moe_data_model_parallel_size=1,
                                  duplicate_tp_group=False, **_):
        tp = tensor_model_parallel_size
        if tp != len(islands[0]) or (pipeline_model_parallel_size, expert_model_parallel_size,
                                     attention_data_parallel_size, attention_context_model_parallel_size,
                                     moe_data_model_parallel_size) != (1, 1, 1, 1, 1) or duplicate_tp_group:
            raise CaptureError("the island seam runs dense tensor parallelism only (pp, ep, dp-attention, cp = 1)",
                               where="capture.sglang", fix="set capture.sglang.ep_size=1 and dp_size=1")
        local = ps.get_world_group().local_rank
        backend = torch.distributed.get_backend(ps.get_world_group().device_group)
        singletons = [[r] for r in range(world)]

        def group(ranks, name, **kw):
            return ps.init_model_parallel_group(ranks, local, backend, group_name=name, **kw)

        # The same creation order on every rank: the groups SGLang builds for world == tp, per island.
        ps._TP = group(islands, "tp", use_message_queue_broadcaster=False)
        ps._ATTN_TP = ps._TP
        ps._MOE_TP = ps._TP
        small = dict(use_pynccl=False, use_custom_allreduce=False)
        ps._ATTN_CP = ps._TP if tp == 1 else group(singletons, "attn_cp", **small)
        ps._MOE_DP = ps._TP if tp == 1 else group(singletons, "moe_dp", **small)
        ps._MOE_EP = ps._TP if tp == 1 else group(singletons, "moe_ep", **small)
        ps._PP = group(singletons, "pp", use_custom_allreduce=False)

    saved = (runner_module.init_distributed_environment, runner_module.initialize_model_parallel)
    runner_module.init_distributed_environment = init_distributed_environment
    runner_module.initialize_model_parallel = initialize_model_parallel
    try:
        yield
    finally:
        runner_module.init_distributed_environment, runner_module.initialize_model_parallel = saved


@dataclass
class _Captured:
    last: torch.Tensor  # [T, H] post-final-norm hidden of every token of the extend
    aux: list[torch.Tensor]  # per captured layer, [T, H], ascending layer order


class _CaptureHead(torch.nn.Module):
    """Stands in for the model's ``LogitsProcessor`` (same forward parameters): no LM head, every
    token's post-norm hidden and the captured aux states. Its return value becomes the
    forward's ``logits_output``."""

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                hidden_states_before_norm=None):
        return _Captured(last=hidden_states, aux=list(aux_hidden_states or ()))


def _install_capture_head(model: torch.nn.Module) -> None:
    from sglang.srt.layers.logits_processor import LogitsProcessor

    found = [name for name, m in model.named_modules() if isinstance(m, LogitsProcessor)]
    if len(found) != 1 or not found[0]:
        raise CaptureError(f"expected one LogitsProcessor submodule in the target, found {found}",
                           where="sglang engine", fix="use a Llama/Qwen-style target (or capture.backend=hf)")
    parent_name, _, child = found[0].rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, _CaptureHead())


def pack_local(aux: Sequence[torch.Tensor], last: torch.Tensor, lengths: Sequence[int], local: slice,
               layer_ids: Sequence[int]) -> PackedCapture:
    """This rank's rows ``local`` (start None: row 0) of one TP-wide extend of rows ``lengths``.

    ``aux`` holds SGLang's captured states, one ``[T, H]`` per layer in ascending layer order
    whatever the order asked; they come back concatenated in the order of ``layer_ids``.
    """
    order = [sorted(layer_ids).index(i) for i in layer_ids]
    start = sum(lengths[: local.start or 0])
    stop = start + sum(lengths[local])
    return PackedCapture(aux=torch.cat([aux[j][start:stop] for j in order], dim=-1), last=last[start:stop],
                         lengths=list(lengths[local]))


class ModelRunnerEngine:
    """SGLang ``ModelRunner`` driven directly; one TP-wide extend per :meth:`capture`."""

    def __init__(self, runner, tree_cache, layer_ids: Sequence[int], place, device: torch.device, *, tp_size: int):
        self.runner, self._tree_cache = runner, tree_cache
        self.layer_ids = tuple(layer_ids)
        self.tp_rank, self.tp_size, self.device = place.tp_rank, tp_size, device
        self._where = f"sglang engine, rank {place.rank} (island {place.island}, tp_rank {place.tp_rank})"
        self._calls = 0

    @classmethod
    def start(cls, args, layer_ids: Sequence[int], *, place, device: torch.device,
              islands: Sequence[Sequence[int]]) -> "ModelRunnerEngine":
        require_sglang()
        gpu_id = device.index if device.index is not None else torch.cuda.current_device()
        # Before any sglang.srt import: some modules read the current device when imported, and the
        # pools use the bare "cuda" device for the engine's whole life.
        torch.cuda.set_device(gpu_id)
        # Colocated ranks hold draft state besides the target, so free memory differs between TP
        # peers; SGLang's start-up check would refuse an island whose free memory differs by > 10 %.
        os.environ.setdefault("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "0")
        islands = [list(g) for g in islands]
        if list(place.island_ranks) not in islands:
            raise CaptureError(f"island {list(place.island_ranks)} is not one of {islands}", where="sglang engine")

        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs(**args.kwargs())
        model_config = ModelConfig.from_server_args(server_args)
        tp = args.get("tp_size")
        with _island_groups(islands):
            runner = ModelRunner(
                model_config=model_config,
                mem_fraction_static=server_args.mem_fraction_static,
                gpu_id=gpu_id,
                tp_rank=place.tp_rank,
                tp_size=tp,
                moe_ep_rank=0,
                moe_ep_size=1,
                pp_rank=0,
                pp_size=1,
                nccl_port=0,  # only builds an init method, unused once torchrun has initialised torch.distributed
                server_args=server_args,
            )
        group = runner.tp_group
        if group.rank_in_group != place.tp_rank or group.world_size != tp or list(group.ranks) != list(place.island_ranks):
            raise CaptureError(f"SGLang's TP group {group.ranks} (rank {group.rank_in_group}) is not this rank's island "
                               f"{list(place.island_ranks)} (tp_rank {place.tp_rank})", where="sglang engine")
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()
        check_engine_pools(rows=runner.max_running_requests, tokens=runner.max_total_num_tokens,
                           need_rows=args.get("max_running_requests") or 0,
                           need_tokens=args.get("max_total_tokens") or 0, where=f"sglang engine, rank {place.rank}")
        runner.model.set_eagle3_layers_to_capture(sorted(layer_ids))
        _install_capture_head(runner.model)
        tree_cache = ChunkCache(CacheInitParams(
            disable=True,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            page_size=server_args.page_size,
        ))
        return cls(runner, tree_cache, layer_ids, place, device, tp_size=tp)

    def capture(self, input_ids: Sequence[Sequence[int]], local: slice) -> PackedCapture:
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        r = self.runner
        check_engine_request(input_ids, context_len=r.model_config.context_len, max_rows=r.max_running_requests,
                             max_tokens=r.max_total_num_tokens, where=self._where)
        check_lockstep(r.tp_group.cpu_group, input_ids, where=self._where)
        self._calls += 1
        reqs = []
        for i, row in enumerate(input_ids):
            ids = array("q", row)
            req = Req(rid=f"capture-{self._calls}-{i}", origin_input_text="", origin_input_ids=ids,
                      sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
            req.full_untruncated_fill_ids = array("q", row)
            req.fill_len = len(row)
            req.set_extend_input_len(len(row))
            reqs.append(req)
        lengths = [len(row) for row in input_ids]
        try:
            batch = ScheduleBatch.init_new(
                reqs=reqs,
                req_to_token_pool=r.req_to_token_pool,
                token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
                tree_cache=self._tree_cache,
                model_config=r.model_config,
                enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE,
            )
            batch.prepare_for_extend()
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
            forward_batch = ForwardBatch.init_new(batch, r)
            with torch.no_grad():
                out = r.forward(forward_batch).logits_output
            if not isinstance(out, _Captured) or len(out.aux) != len(self.layer_ids):
                raise CaptureError(
                    f"SGLang returned {len(getattr(out, 'aux', []))} aux states for layers {self.layer_ids}",
                    where=self._where, fix="check the layer ids against the target's layer count",
                )
            packed = pack_local(out.aux, out.last, lengths, local, self.layer_ids)
        finally:
            r.req_to_token_pool.clear()
            r.token_to_kv_pool_allocator.clear()
        return packed

    def shutdown(self) -> None:
        """Drop the runner and SGLang's groups (never torchrun's default group)."""
        from sglang.srt.distributed import parallel_state as ps

        self.runner = self._tree_cache = None
        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None
        torch.cuda.empty_cache()
