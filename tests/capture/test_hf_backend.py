"""The hf capture backend: hooks give the EAGLE3 capture layers and the teacher's input, exactly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge_core.capture import build_capture_backend
from specforge_core.capture.base import CapturedBatch
from specforge_core.capture.hf import HFCaptureBackend
from specforge_core.capture.target_info import default_capture_layers
from specforge_core.config import load_config
from specforge_core.errors import ConfigError, ModelError

from .conftest import make_request


def config_for(model_dir, *overrides):
    return load_config(None, [f"model.target={model_dir}", "capture.device=cpu", "data.max_length=256", *overrides])


def backend_for(model_dir, *overrides) -> HFCaptureBackend:
    return HFCaptureBackend.from_config(config_for(model_dir, *overrides), device=torch.device("cpu"))


def reference(model_dir, request):
    """Transformers' own outputs for the request, each row run alone (no padding at all)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids]), output_hidden_states=True) for ids in request.input_ids]


def assert_matches_reference(batch: CapturedBatch, refs, layer_ids, lm_head):
    for row, ref in enumerate(refs):
        n = int(batch.attention_mask[row].sum())
        want_aux = torch.cat([ref.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(batch.aux_hidden[row, :n], want_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch.last_hidden[row, :n] @ lm_head.T, ref.logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch_dir", ["tiny_target_dir", "tiny_qwen3_dir"])
def test_aux_is_hidden_states_i_plus_1_and_last_hidden_gives_the_logits(arch_dir, request):
    model_dir = request.getfixturevalue(arch_dir)
    backend = backend_for(model_dir)
    req = make_request([7, 12, 3])
    assert_matches_reference(backend.capture(req), reference(model_dir, req), backend.layer_ids, backend.lm_head_weight)


def test_tied_embeddings_use_the_embedding_as_the_head(tiny_tied_dir):
    backend = backend_for(tiny_tied_dir)
    assert backend.lm_head_weight.data_ptr() == backend.embed_weight.data_ptr()
    req = make_request([9, 5])
    assert_matches_reference(backend.capture(req), reference(tiny_tied_dir, req), backend.layer_ids, backend.lm_head_weight)


def test_default_capture_layers_are_1_half_minus_1_and_n_minus_4(tiny_target_dir):
    assert backend_for(tiny_target_dir).layer_ids == default_capture_layers(8) == (1, 3, 4)


def test_configured_capture_layers_win(tiny_target_dir):
    assert backend_for(tiny_target_dir, "model.capture_layer_ids=[0, 2, 7]").layer_ids == (0, 2, 7)


def test_the_last_layer_id_is_its_output_before_the_final_norm(tiny_target_dir):
    backend = backend_for(tiny_target_dir, "model.capture_layer_ids=[0, 2, 7]")
    batch = backend.capture(make_request([6]))
    layer7 = batch.aux_hidden[0, :, 2 * backend.hidden_size :]
    torch.testing.assert_close(backend.model.model.norm(layer7), batch.last_hidden[0])


def test_draft_config_capture_layers_are_used_when_the_model_sets_none(tiny_target_dir):
    draft = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}
    backend = HFCaptureBackend.from_config(config_for(tiny_target_dir), device=torch.device("cpu"), draft_config=draft)
    assert backend.layer_ids == (2, 4, 6)


def test_a_capture_layer_beyond_the_target_is_refused_naming_the_field(tiny_target_dir):
    with pytest.raises(ModelError, match=r"model.capture_layer_ids.*\[0, 8\)"):
        backend_for(tiny_target_dir, "model.capture_layer_ids=[1, 3, 8]")


def test_the_lm_head_never_runs(tiny_target_dir):
    backend = backend_for(tiny_target_dir)
    calls = []
    backend.model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    backend.capture(make_request([5, 5]))
    assert calls == []


def test_the_target_is_frozen_and_in_eval_mode(tiny_target_dir):
    backend = backend_for(tiny_target_dir)
    assert not backend.model.training
    assert not any(p.requires_grad for p in backend.model.parameters())


def test_captured_tensors_can_feed_a_trained_layer(tiny_target_dir):
    batch = backend_for(tiny_target_dir).capture(make_request([4, 6]))
    assert not batch.aux_hidden.is_inference() and not batch.last_hidden.is_inference()
    fc = torch.nn.Linear(batch.aux_hidden.shape[-1], 8)
    fc(batch.aux_hidden).sum().backward()
    assert fc.weight.grad is not None


def test_a_tp_wide_request_returns_only_the_local_rows_trimmed_and_owned(tiny_target_dir):
    backend = backend_for(tiny_target_dir)
    req = make_request([3, 4, 11, 5], local=slice(2, 4))
    full = backend.capture(make_request([3, 4, 11, 5]))
    mine = backend.capture(req)
    assert mine.task_ids == ("task2", "task3") and mine.input_ids.shape == (2, 11)
    torch.testing.assert_close(mine.aux_hidden, full.aux_hidden[2:4, :11])
    for t in (mine.aux_hidden, mine.last_hidden):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_batch_fields_follow_the_captured_batch_contract(tiny_target_dir):
    backend = backend_for(tiny_target_dir)
    batch = backend.capture(make_request([3, 6]))
    h = backend.hidden_size
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.loss_mask.shape == (2, 6)
    assert batch.aux_hidden.shape == (2, 6, 3 * h) and batch.last_hidden.shape == (2, 6, h)
    assert batch.attention_mask.tolist()[0] == [1, 1, 1, 0, 0, 0]
    assert batch.input_ids.dtype == torch.long and batch.position_ids is None and batch.seq_ids is None


def test_build_capture_backend_checks_context_headroom_before_loading(tiny_target_dir):
    with pytest.raises(ConfigError, match="data.max_length"):
        build_capture_backend(config_for(tiny_target_dir, "data.max_length=1020"))


@pytest.mark.slow
def test_smollm2_capture_matches_transformers(smollm2_dir):
    backend = backend_for(smollm2_dir)
    assert backend.layer_ids == (1, 14, 26)
    req = make_request([24, 17], vocab=49152)
    assert_matches_reference(backend.capture(req), reference(smollm2_dir, req), backend.layer_ids, backend.lm_head_weight)


def test_hidden_states_at_padded_positions_are_zero(tiny_target_dir):
    batch = backend_for(tiny_target_dir).capture(make_request([3, 6]))
    assert batch.aux_hidden[0, 3:].abs().sum() == 0 and batch.last_hidden[0, 3:].abs().sum() == 0


@pytest.mark.parametrize("arch_dir", ["tiny_target_dir", "tiny_qwen3_dir"])
def test_compiled_target_layers_are_one_graph_for_every_layer_and_packing_and_capture_the_same(arch_dir, request):
    """training.compile on CUDA compiles each decoder layer as one region (system.compile's
    compile_target). All layers and every packing (token and sample counts, one sample alone)
    share one graph, traced through the packed attention as one op (no graph break), and the
    capture equals the uncompiled one."""
    from dataclasses import replace

    from specforge_core.system.compile import compile_target

    model_dir = request.getfixturevalue(arch_dir)
    eager, compiled = backend_for(model_dir), backend_for(model_dir)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layers = len(compiled._decoder.layers)
    assert compile_target(compiled._decoder, backend=record) == layers + 1  # the layers and the final norm
    for seed, lengths in enumerate(([5, 9, 3], [7, 11], [4, 6, 8, 2], [13])):
        packed = replace(make_request(lengths, seed=seed), token_budget=64)
        want, got = eager.capture(packed), compiled.capture(packed)
        torch.testing.assert_close(got.aux_hidden, want.aux_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.last_hidden, want.last_hidden, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1
    ops = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert ops.count(torch.ops.specforge.varlen_attention.default) == 1
