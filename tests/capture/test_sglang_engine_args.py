"""SGLang engine arguments: resolved once, two views (argv, kwargs) that agree."""

from specforge_core.capture.sglang_backend import SGLangEngineArgs
from specforge_core.config import SGLANG_RESOLVED_FIELDS, load_config
from specforge_core.run.topology import Topology


def resolve(*overrides) -> SGLangEngineArgs:
    cfg = load_config(None, [
        "model.target=/models/qwen3-8b", "capture.backend=sglang", "capture.tp_size=2",
        "deployment.nproc_per_node=4", "training.batch_size=3", "data.max_length=1024", *overrides,
    ])
    return SGLangEngineArgs.resolve(cfg, Topology.from_config(cfg))


def parse_argv(argv: list[str]) -> dict:
    """Read launch_server-style argv back into kwargs (bare flag = True)."""
    out, i = {}, 0
    while i < len(argv):
        name = argv[i].removeprefix("--").replace("-", "_")
        values = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
            i += 1
        out[name] = True if not values else values[0] if len(values) == 1 else values
        i += 1
    return out


def as_cli_strings(kwargs: dict) -> dict:
    return {k: v if v is True else [str(x) for x in v] if isinstance(v, list) else str(v)
            for k, v in kwargs.items() if v is not False}


def test_argv_and_kwargs_views_agree():
    args = resolve()
    assert parse_argv(args.argv()) == as_cli_strings(args.kwargs())


def test_argv_and_kwargs_agree_with_extra_fields_lists_and_flags():
    args = resolve("capture.sglang.extra={enable_torch_compile: true, cuda_graph_bs: [1, 2], max_prefill_tokens: 16384}")
    assert parse_argv(args.argv()) == as_cli_strings(args.kwargs())
    assert args.kwargs()["cuda_graph_bs"] == [1, 2] and "--enable-torch-compile" in args.argv()


def test_capacity_defaults_to_one_tp_wide_batch():
    kw = resolve().kwargs()
    assert kw["max_running_requests"] == 2 * 3
    assert kw["max_total_tokens"] == 2 * 3 * 1024
    assert kw["context_length"] == 1024


def test_explicit_engine_fields_win():
    kw = resolve("capture.sglang.max_total_tokens=100000", "capture.sglang.context_length=4096",
                 "capture.sglang.mem_fraction_static=0.3").kwargs()
    assert (kw["max_total_tokens"], kw["context_length"], kw["mem_fraction_static"]) == (100000, 4096, 0.3)


def test_one_engine_per_island_with_whole_batch_extend_and_hidden_states():
    kw = resolve().kwargs()
    assert (kw["tp_size"], kw["pp_size"], kw["dp_size"]) == (2, 1, 1)
    assert kw["chunked_prefill_size"] == -1
    assert kw["disable_cuda_graph"] and kw["enable_return_hidden_states"] and kw["skip_tokenizer_init"]
    assert kw["model_path"] == "/models/qwen3-8b" and kw["dtype"] == "bfloat16"


def test_resolved_fields_are_the_ones_config_protects_from_extra():
    assert tuple(resolve().kwargs()) == SGLANG_RESOLVED_FIELDS
