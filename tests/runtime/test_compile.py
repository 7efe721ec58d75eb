"""system/compile.py: which passes torch.compile takes (training.compile) and where its caches go."""

import os
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from specforge_core.config import load_config
from specforge_core.system import compile as comp


def _double(x):
    return 2 * x


def test_fused_compiles_only_for_cuda_and_only_when_asked():
    assert comp.fused(_double, torch.device("cuda"), False) is _double
    compiled = comp.fused(_double, torch.device("cuda"), True)  # wrapping compiles nothing yet: no GPU needed
    assert compiled is not _double and comp.fused(_double, "cuda", True) is compiled
    assert comp.fused(_double, "cuda", False) is _double  # the compiled one changed nothing for others
    assert comp.fused(_double, torch.device("cpu"), True) is _double


def _scores(logits, teacher, label, keys):
    return (logits.float().softmax(-1) * teacher[label].float()).sum(-1) + keys[0].sum((-1, -2))


def test_fused_functions_compile_their_row_counts_symbolic_and_every_model_size_constant():
    """One graph serves every row count (the unroll's change every step; a single row is its own
    graph, as torch specialises sizes of 1); the vocabulary, heads and head size are constants in
    both, also for tensors in lists and rows after a leading batch of one."""
    graphs = []

    def capture(gm, example_inputs):  # the traced inputs' shapes, symbolic where dynamic
        values = [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]
        graphs.append([tuple(v.shape) for v in values if isinstance(v, torch.Tensor)])
        return gm.forward

    run = comp.rows_dynamic(torch.compile(_scores, dynamic=True, backend=capture))
    for n in (5, 9, 12, 1):
        logits, teacher, label = torch.randn(n, 40), torch.randn(7, 40), torch.randint(7, (n,))
        keys = [torch.randn(1, n, 2, 8)]
        torch.testing.assert_close(run(logits, teacher, label, keys), _scores(logits, teacher, label, keys))
    assert len(graphs) == 2  # rows 5, 9, 12; then the single row
    many, single = graphs
    assert all(isinstance(count, torch.SymInt) for count in (many[0][0], many[2][0], many[3][1]))
    assert (single[0][0], single[2][0], single[3][1]) == (1, 1, 1)
    for logits, teacher, _, keys in graphs:
        constants = (logits[1], teacher[1], keys[0], *keys[2:])  # a SymInt would compare equal by its hint
        assert all(type(size) is int for size in constants) and constants == (40, 40, 1, 2, 8)


def _project(x, weight, cos):
    return (x @ weight.t()).view(*x.shape[:2], -1, cos.shape[-1]) * cos[:, :, None]


def test_regions_compile_their_row_counts_symbolic_and_a_weight_given_as_input_constant():
    """The layer's regions (matrix_rows=False): a 2-D input is a weight (the q/k/v hidden half
    the training step folds), every one of its sizes a constant, like the heads and head size of
    the rows-first inputs; only the rows (dim 1) are symbolic."""
    graphs = []

    def capture(gm, example_inputs):  # each input tensor's traced shape by its name (l_x_ for x)
        values = {node.name[2:-1]: node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"}
        graphs.append({name: tuple(v.shape) for name, v in values.items() if isinstance(v, torch.Tensor)})
        return gm.forward

    run = comp.rows_dynamic(torch.compile(_project, dynamic=True, backend=capture), matrix_rows=False)
    weight = torch.randn(24, 16)
    for n in (5, 9, 12):
        x, cos = torch.randn(1, n, 16), torch.randn(1, n, 8)
        torch.testing.assert_close(run(x, weight, cos=cos), _project(x, weight, cos))
    assert len(graphs) == 1
    x, weight, cos = (graphs[0][name] for name in ("x", "weight", "cos"))
    assert isinstance(x[1], torch.SymInt) and isinstance(cos[1], torch.SymInt)
    constants = (*weight, x[2], cos[2])
    assert all(type(size) is int for size in constants) and constants == (24, 16, 16, 8)


def test_two_objectives_of_one_process_compile_or_not_each_as_its_config_says(tiny_target_dir, monkeypatch):
    from specforge_core.drafts import get_family
    from specforge_core.drafts.eagle3 import attention, rows
    from specforge_core.drafts.vocab import soft_target_ce, teacher
    from specforge_core.launch.builder import build_draft, build_objective
    from tests.drafts.eagle3.fixtures import hf_backend, random_batch, random_vocab_map

    asked = []
    for module in (attention, rows, soft_target_ce, teacher):  # every fused call site of the EAGLE3 objective
        monkeypatch.setattr(module, "fused", lambda fn, device, enabled: (asked.append(enabled), fn)[1])
    backend, family = hf_backend(tiny_target_dir), get_family("eagle3")
    vocab = random_vocab_map(backend.vocab_size, 64)
    runs = {}
    for compile in (True, False):
        cfg = load_config(None, [f"model.target={tiny_target_dir}", "draft.draft_vocab_size=64",
                                 "training.ttt_length=3", f"training.compile={str(compile).lower()}"])
        runs[compile] = build_draft(cfg, family, backend, vocab), build_objective(cfg, family, backend)[0]
    batch = random_batch(1, [10, 7], 10, backend.hidden_size, vocab=backend.vocab_size)
    for compile in (True, False, True):  # interleaved: neither run's setting leaks into the other's
        draft, loss_of = runs[compile]
        asked.clear()
        loss_of(draft, batch)[0].backward()  # the backward's fused passes read the setting from the ctx
        assert asked and set(asked) == {compile}


def test_the_draft_layer_is_compiled_as_its_two_regions_and_nothing_inside_it_twice():
    from tests.drafts.eagle3.fixtures import tiny_draft

    draft = tiny_draft(seed=1)
    eager = {name: getattr(draft.midlayer, name) for name in ("project_qkv", "complete")}
    assert comp.compile_pointwise(draft) == 3  # the layer's two regions and the final norm
    for name, method in eager.items():  # compiling is lazy: nothing is traced until a call
        assert getattr(draft.midlayer, name) is not method and name in vars(draft.midlayer)
    assert draft.norm._compiled_call_impl is not None
    assert all(m._compiled_call_impl is None for m in draft.midlayer.modules())


def test_compile_cache_points_inductor_at_the_run_directory_for_the_block_only(tmp_path, monkeypatch):
    monkeypatch.delenv(comp.CACHE_ENV, raising=False)
    with comp.compile_cache(tmp_path / "run" / "compile-cache") as where:
        assert os.environ[comp.CACHE_ENV] == str(where) == str((tmp_path / "run" / "compile-cache").resolve())
    assert comp.CACHE_ENV not in os.environ
    assert not (tmp_path / "run").exists()  # nothing compiled, nothing created


def test_a_cache_directory_the_user_set_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(comp.CACHE_ENV, str(tmp_path / "mine"))
    with comp.compile_cache(tmp_path / "run" / "compile-cache") as where:
        assert where == tmp_path / "mine" and os.environ[comp.CACHE_ENV] == str(tmp_path / "mine")
    assert os.environ[comp.CACHE_ENV] == str(tmp_path / "mine")


def test_a_mask_inductor_cannot_compile_is_built_eagerly_with_a_warning(monkeypatch):
    # integer division of a clamped symbolic index: what torch 2.13's inductor cannot simplify
    monkeypatch.setattr(comp, "_EAGER_MASKS", set())

    def by_division(b, h, q, kv):
        return (kv - 32).clamp(min=0) // 8 == q // 8

    sizes = dict(B=1, H=None, Q_LEN=64, KV_LEN=96, device="cpu", BLOCK_SIZE=8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = comp.build_block_mask(by_division, compiled=True, **sizes)
    assert torch.equal(got.to_dense(), create_block_mask(by_division, **sizes).to_dense())
    fell_back = [w for w in seen if "building masks eagerly" in str(w.message)]
    if not fell_back:
        pytest.skip("this torch's inductor compiles the predicate: no failure to fall back from")
    assert fell_back[0].category is RuntimeWarning and comp._EAGER_MASKS == {"cpu"}
