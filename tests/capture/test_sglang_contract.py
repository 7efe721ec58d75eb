"""The SGLang seam against the pinned wheel's source: every name, signature and field it relies on.

SGLang cannot be imported on a CPU (its CUDA modules load at import), so this parses the source
of the wheel ``make install`` fetched (``fixtures/wheels.py``) with ``ast``. It fails when the
pin moves (``SGLANG_VERSION``, the ``sglang`` extra, the wheel) and this contract was not read
again for the new version: update ``CONTRACT_READ_FOR`` only after re-reading every item below
against the new source and re-running ``bench/gpu_sglang_check.py`` on a GPU.
"""

import ast
import re
import tomllib
import zipfile
from pathlib import Path

import pytest

from fixtures.wheels import wheel_path
from specforge_core.capture import sglang_engine
from specforge_core.capture.sglang_backend import SGLangEngineArgs
from specforge_core.capture.sglang_engine import SGLANG_VERSION
from specforge_core.config import load_config
from specforge_core.run.topology import Topology

CONTRACT_READ_FOR = "0.5.14"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel():
    with zipfile.ZipFile(wheel_path("sglang", SGLANG_VERSION)) as zf:
        yield zf


def source(wheel, path: str) -> ast.Module:
    return ast.parse(wheel.read(f"sglang/{path}").decode())


def cls(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} is gone"
    return found[0]


def fn(node, name: str) -> ast.FunctionDef:
    found = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    assert found, f"{getattr(node, 'name', 'module')}.{name} is gone"
    return found[0]


def params(f: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)]


def assigned_self_attrs(node) -> set[str]:
    return {t.attr for n in ast.walk(node) for t in getattr(n, "targets", [getattr(n, "target", None)])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def keywords_of_calls(node, callee: str) -> set[str]:
    return {k.arg for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == callee
            for k in n.keywords}


def has_params(f: ast.FunctionDef, *names: str) -> None:
    missing = [n for n in names if n not in params(f)]
    assert not missing, f"{f.name} lost parameters {missing}: {params(f)}"


def test_the_pin_is_the_version_this_contract_was_read_for(wheel):
    assert SGLANG_VERSION == CONTRACT_READ_FOR, "re-read this contract against the new SGLang, then update it"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert extra == [f"sglang=={SGLANG_VERSION}"]
    version = wheel.read("sglang/_version.py").decode()
    assert re.search(rf"__version__ = version = '{re.escape(SGLANG_VERSION)}'", version)


def test_every_sglang_name_the_seam_imports_is_defined_where_it_imports_it(wheel):
    seam = ast.parse(Path(sglang_engine.__file__).read_text())
    imports = [(n.module, a.name) for n in ast.walk(seam) if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("sglang") for a in n.names]
    imports += [(n.names[0].name.rsplit(".", 1)[0], n.names[0].name.rsplit(".", 1)[1]) for n in ast.walk(seam)
                if isinstance(n, ast.Import) and n.names[0].name.startswith("sglang.")]
    assert len(imports) >= 10
    files = set(wheel.namelist())
    for module, name in imports:
        path = module.replace(".", "/")
        if f"{path}/{name}.py" in files or f"{path}/{name}/__init__.py" in files:
            continue  # a submodule
        tree = ast.parse(wheel.read(f"{path}.py" if f"{path}.py" in files else f"{path}/__init__.py").decode())
        defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        defined |= {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in getattr(n, "targets", [getattr(n, "target", None)]) if isinstance(t, ast.Name)}
        defined |= {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        assert name in defined, f"{module}.{name} is gone"


def test_model_runner_takes_what_the_seam_passes_and_leaves_three_init_calls(wheel):
    tree = source(wheel, "srt/model_executor/model_runner.py")
    runner = cls(tree, "ModelRunner")
    has_params(fn(runner, "__init__"), "model_config", "mem_fraction_static", "gpu_id", "tp_rank", "tp_size",
               "moe_ep_rank", "moe_ep_size", "pp_rank", "pp_size", "nccl_port", "server_args")
    for method in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs"):
        fn(runner, method)
    has_params(fn(runner, "forward"), "forward_batch")
    assert {"tp_group", "model", "model_config", "server_args", "req_to_token_pool",
            "token_to_kv_pool_allocator"} <= assigned_self_attrs(runner)
    fields = [n.target.id for n in cls(tree, "ModelRunnerOutput").body if isinstance(n, ast.AnnAssign)]
    assert fields[0] == "logits_output"
    mixin = source(wheel, "srt/model_executor/model_runner_kv_cache_mixin.py")
    assert {"max_total_num_tokens", "max_running_requests"} <= assigned_self_attrs(mixin)


def test_the_two_group_builders_are_called_by_name_with_the_keywords_the_seam_reads(wheel):
    tree = source(wheel, "srt/model_executor/model_runner.py")
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.distributed"
                for a in n.names}
    assert {"init_distributed_environment", "initialize_model_parallel"} <= imported
    dist = fn(cls(tree, "ModelRunner"), "init_torch_distributed")
    assert {"backend", "local_rank"} <= keywords_of_calls(dist, "init_distributed_environment")
    assert {"tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "attention_data_parallel_size", "attention_context_model_parallel_size",
            "moe_data_model_parallel_size", "duplicate_tp_group"} >= keywords_of_calls(dist, "initialize_model_parallel") - {
        "enable_symm_mem", "recovered_rank"}, "initialize_model_parallel gained a keyword the island builder ignores"


def test_parallel_state_has_the_groups_and_builders_the_island_swap_sets(wheel):
    tree = source(wheel, "srt/distributed/parallel_state.py")
    coordinator = cls(tree, "GroupCoordinator")
    has_params(fn(coordinator, "__init__"), "group_ranks", "local_rank", "torch_distributed_backend", "use_pynccl",
               "use_pymscclpp", "use_custom_allreduce", "use_torch_symm_mem_all_reduce", "use_hpu_communicator",
               "use_xpu_communicator", "use_npu_communicator", "group_name")
    assert {"rank_in_group", "world_size", "ranks", "cpu_group", "device_group", "local_rank"} <= assigned_self_attrs(coordinator)
    fn(coordinator, "destroy")
    has_params(fn(tree, "init_model_parallel_group"), "group_ranks", "local_rank", "backend", "use_pynccl",
               "use_custom_allreduce", "use_message_queue_broadcaster", "group_name")
    fn(tree, "destroy_model_parallel")
    fn(tree, "get_world_group")
    globals_ = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"_WORLD", "_TP", "_ATTN_TP", "_ATTN_CP", "_MOE_DP", "_MOE_EP", "_MOE_TP", "_PP"} <= globals_


def test_one_extend_is_built_from_the_fields_the_seam_sets(wheel):
    tree = source(wheel, "srt/managers/schedule_batch.py")
    req = cls(tree, "Req")
    assert params(fn(req, "__init__"))[1:5] == ["rid", "origin_input_text", "origin_input_ids", "sampling_params"]
    assert {"full_untruncated_fill_ids", "fill_len"} <= assigned_self_attrs(fn(req, "__init__"))
    has_params(fn(req, "set_extend_input_len"), "extend_input_len")
    batch = cls(tree, "ScheduleBatch")
    has_params(fn(batch, "init_new"), "reqs", "req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache",
               "model_config", "enable_overlap", "spec_algorithm")
    extend = fn(batch, "prepare_for_extend")
    assert {"prefill_input_ids_cpu", "input_ids"} <= assigned_self_attrs(extend)
    assert "device" in {n.target.id for n in batch.body if isinstance(n, ast.AnnAssign)}
    forward_batch = cls(source(wheel, "srt/model_executor/forward_batch_info.py"), "ForwardBatch")
    assert params(fn(forward_batch, "init_new")) == ["cls", "batch", "model_runner"]
    assert "NONE" in {t.id for n in cls(source(wheel, "srt/speculative/spec_info.py"), "SpeculativeAlgorithm").body
                      for t in getattr(n, "targets", []) if isinstance(t, ast.Name)}
    has_params(fn(cls(source(wheel, "srt/sampling/sampling_params.py"), "SamplingParams"), "__init__"),
               "max_new_tokens", "temperature")


def test_the_pools_are_cleared_and_the_cache_is_stateless(wheel):
    fn(cls(source(wheel, "srt/mem_cache/memory_pool.py"), "ReqToTokenPool"), "clear")
    fn(cls(source(wheel, "srt/mem_cache/allocator/token.py"), "TokenToKVPoolAllocator"), "clear")
    has_params(fn(cls(source(wheel, "srt/mem_cache/chunk_cache.py"), "ChunkCache"), "__init__"), "params")
    fields = [n.target.id for n in cls(source(wheel, "srt/mem_cache/cache_init_params.py"), "CacheInitParams").body
              if isinstance(n, ast.AnnAssign)]
    assert {"disable", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size"} <= set(fields)


def test_the_model_config_and_every_resolved_server_arg_exist(wheel):
    config = cls(source(wheel, "srt/configs/model_config.py"), "ModelConfig")
    has_params(fn(config, "from_server_args"), "server_args")
    assert {"context_len", "num_hidden_layers"} <= assigned_self_attrs(config)
    server_args = cls(source(wheel, "srt/server_args.py"), "ServerArgs")
    fields = {n.target.id for n in server_args.body if isinstance(n, ast.AnnAssign)}
    cfg = load_config(None, ["model.target=/m", "capture.backend=sglang", "capture.device=cuda"])
    missing = sorted(set(SGLangEngineArgs.resolve(cfg, Topology.from_config(cfg)).kwargs()) - fields)
    assert not missing, f"ServerArgs lost {missing}"


def test_capture_keeps_the_input_of_layer_id_plus_one_and_hands_it_to_the_logits_processor(wheel):
    processor = cls(source(wheel, "srt/layers/logits_processor.py"), "LogitsProcessor")
    assert params(fn(processor, "forward")) == ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata",
                                                 "aux_hidden_states", "hidden_states_before_norm"]
    for path, model, inner in (("srt/models/llama.py", "LlamaForCausalLM", "LlamaModel"),
                               ("srt/models/qwen3.py", "Qwen3ForCausalLM", None)):
        tree = source(wheel, path)
        causal = cls(tree, model)
        setter = fn(causal, "set_eagle3_layers_to_capture")
        plus_one = [n for n in ast.walk(setter) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add)
                    and isinstance(n.right, ast.Constant) and n.right.value == 1]
        assert plus_one, f"{model}.set_eagle3_layers_to_capture no longer stores id + 1"
        assert "logits_processor" in assigned_self_attrs(fn(causal, "__init__"))
        calls = [n for n in ast.walk(fn(causal, "forward")) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "logits_processor"]
        assert calls and any(len(c.args) == 5 for c in calls), f"{model}.forward passes the aux states differently"
        if inner:
            body = fn(cls(tree, inner), "forward")
            assert any(isinstance(n, ast.Compare) and any(getattr(c, "attr", None) == "layers_to_capture"
                                                          for c in n.comparators) for n in ast.walk(body))
