"""Token-budget packing: a packed capture gives every sample exactly its unpacked states."""

from dataclasses import replace

import pytest
import torch

from specforge_core.capture import build_capture_backend
from fixtures.fake_sglang import FakeSGLangEngine
from specforge_core.capture.hf import HFCaptureBackend
from specforge_core.capture.packing import RowLayout, balanced_rows
from specforge_core.config import load_config
from specforge_core.errors import ConfigError
from specforge_core.run.topology import Topology

from .conftest import make_request


def packed(request, token_budget):
    return replace(request, token_budget=token_budget)


def per_sample(batch):
    """{sample index: (aux, last, input_ids, loss_mask)} read back out of a batch, packed or not."""
    out = {}
    for row in range(batch.batch_size):
        if batch.seq_ids is None:
            n = int(batch.attention_mask[row].sum())
            spans = [(row, 0, n)]
        else:
            seq = batch.seq_ids[row].tolist()
            spans = [(s, seq.index(s), seq.index(s) + seq.count(s)) for s in sorted(set(seq) - {-1})]
        for sample, start, end in spans:
            out[sample] = tuple(
                t[row, start:end] for t in (batch.aux_hidden, batch.last_hidden, batch.input_ids, batch.loss_mask)
            )
    return out


def assert_same_samples(packed_batch, plain_batch):
    got, want = per_sample(packed_batch), per_sample(plain_batch)
    assert sorted(got) == sorted(want)
    for sample in want:
        for g, w in zip(got[sample], want[sample]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def hf_backend(tiny_qwen3_dir):
    cfg = load_config(None, [f"model.target={tiny_qwen3_dir}", "capture.device=cpu", "data.max_length=256"])
    return HFCaptureBackend.from_config(cfg, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def sglang_backend(tiny_target_dir):
    cfg = load_config(None, [
        f"model.target={tiny_target_dir}", "capture.backend=sglang", "data.max_length=256", "model.dtype=float32",
        "training.batch_size=8",
    ])
    return build_capture_backend(cfg, topology=Topology.from_config(cfg), engine_factory=FakeSGLangEngine.start)


def test_rows_start_from_the_fewest_that_could_fit_the_budget():
    assert balanced_rows([10, 20, 30, 40], token_budget=100) == [[0, 1, 2, 3]]
    assert len(balanced_rows([60, 60, 60], token_budget=100)) == 3
    assert balanced_rows([50, 45, 40, 35, 30], token_budget=100) == [[0], [1, 4], [2, 3]]  # 50, 75, 75


def test_every_sample_is_placed_once_and_rows_keep_sample_order():
    rows = balanced_rows([7, 3, 9, 1, 4, 8, 2], token_budget=12)
    assert sorted(i for row in rows for i in row) == list(range(7))
    assert all(row == sorted(row) for row in rows)


def test_rows_never_exceed_the_budget_and_are_balanced():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 2000, (64,), generator=g).tolist()
    layout = RowLayout.packed_rows(lengths, token_budget=8192)
    loads = [sum(lengths[i] for i in row) for row in layout.rows]
    assert max(loads) <= 8192 and len(loads) == -(-sum(lengths) // 8192)
    assert layout.padding_fraction < 0.05


def test_a_sample_longer_than_the_budget_names_the_field():
    with pytest.raises(ConfigError, match="training.token_budget"):
        balanced_rows([10, 300], token_budget=256)


def test_packed_hf_capture_equals_unpacked_capture_per_sample(hf_backend):
    request = make_request([7, 12, 3, 9, 5])
    assert_same_samples(hf_backend.capture(packed(request, 24)), hf_backend.capture(request))


def test_a_packed_tp_wide_request_keeps_only_the_local_samples(hf_backend):
    request = make_request([6, 11, 4, 8], local=slice(2, 4))
    batch = hf_backend.capture(packed(request, 64))
    assert batch.task_ids == ("task2", "task3") and batch.input_ids.shape == (1, 12)
    assert_same_samples(batch, hf_backend.capture(request))


def test_packed_rows_carry_restarting_positions_and_sample_ids(hf_backend):
    batch = hf_backend.capture(packed(make_request([3, 2, 4]), 5))
    assert batch.input_ids.shape == (2, 5)
    seqs = batch.seq_ids.tolist()
    for row, seq in enumerate(seqs):
        for sample in set(seq) - {-1}:
            assert [p for p, s in zip(batch.position_ids[row].tolist(), seq) if s == sample] == list(
                range(seq.count(sample))
            )
    assert batch.attention_mask.tolist() == [[int(s >= 0) for s in row] for row in seqs]
    assert sum(s == -1 for row in seqs for s in row) == 1  # 10 slots, 9 tokens


def test_padding_slots_of_packed_rows_are_zero(hf_backend):
    batch = hf_backend.capture(packed(make_request([3, 2, 4]), 5))
    pad = batch.seq_ids < 0
    assert batch.aux_hidden[pad].abs().sum() == 0 and batch.last_hidden[pad].abs().sum() == 0


def test_packed_capture_owns_ordinary_tensors(hf_backend):
    batch = hf_backend.capture(packed(make_request([5, 6]), 16))
    for t in (batch.aux_hidden, batch.last_hidden):
        assert not t.is_inference() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_the_unpacked_forward_is_unchanged_by_the_packed_attention(hf_backend, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    request = make_request([7, 4])
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([request.input_ids[1]]), output_hidden_states=True)
    batch = hf_backend.capture(request)
    torch.testing.assert_close(batch.last_hidden[1, :4] @ hf_backend.lm_head_weight.T, ref.logits[0], rtol=1e-4, atol=1e-4)


def test_packed_sglang_capture_equals_unpacked_capture_per_sample(sglang_backend):
    request = make_request([9, 4, 13, 2], local=slice(0, 4))
    assert_same_samples(sglang_backend.capture(packed(request, 16)), sglang_backend.capture(request))


def test_a_budget_below_max_length_is_refused_before_loading(tiny_target_dir):
    cfg = load_config(None, [
        f"model.target={tiny_target_dir}", "capture.device=cpu", "data.max_length=256", "training.token_budget=128",
    ])
    with pytest.raises(ConfigError, match="training.token_budget=128 is shorter than data.max_length=256"):
        build_capture_backend(cfg)


def test_a_packed_batch_counts_its_samples_not_its_rows(hf_backend):
    batch = hf_backend.capture(packed(make_request([3, 2, 4]), 16))
    assert batch.batch_size == 1 and batch.num_samples == 3


# --- a family that reads K layers and no final hidden (DFlash) -------------------------------------


@pytest.mark.parametrize("backend_name", ["hf", "sglang"])
def test_k_layers_without_the_final_hidden_are_captured_packed_or_not(backend_name, tiny_target_dir):
    ids = (1, 2, 4, 5, 6)
    cfg = load_config(None, [f"model.target={tiny_target_dir}", f"capture.backend={backend_name}",
                             "data.max_length=256", "model.dtype=float32", "draft.family=dflash",
                             "training.batch_size=4"])
    backend = build_capture_backend(cfg, topology=Topology.from_config(cfg), layer_ids=ids, last_hidden=False,
                                    engine_factory=FakeSGLangEngine.start)
    request = make_request([9, 5, 7, 3], local=slice(0, 4))
    plain, pack = backend.capture(request), backend.capture(packed(request, token_budget=16))
    assert backend.layer_ids == ids and plain.last_hidden is None and pack.last_hidden is None
    assert plain.aux_hidden.shape[-1] == len(ids) * backend.hidden_size
    for sample in range(4):
        rows = pack.seq_ids == sample
        n = int(rows.sum())
        torch.testing.assert_close(pack.aux_hidden[rows], plain.aux_hidden[sample, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("budget", [None, 16], ids=["unpacked", "packed"])
@pytest.mark.parametrize("which", ["hf_backend", "sglang_backend"])
def test_the_host_masks_hold_the_device_masks(which, budget, request):
    backend = request.getfixturevalue(which)
    req = make_request([9, 4, 13, 2], local=slice(1, 4))
    batch = backend.capture(req if budget is None else packed(req, budget))
    host = batch.host_masks
    assert host is not None and host.attention_mask.device.type == "cpu"
    assert torch.equal(host.attention_mask, batch.attention_mask.cpu())
    assert torch.equal(host.loss_mask, batch.loss_mask.cpu())
    if budget is None:
        assert host.seq_ids is None and batch.seq_ids is None
    else:
        assert torch.equal(host.seq_ids, batch.seq_ids.cpu())
    assert batch.num_tokens == 4 + 13 + 2


def test_a_packed_capture_builds_no_mask_and_never_reads_its_positions(hf_backend, monkeypatch):
    import transformers.masking_utils as masking

    calls = []
    for name in ("find_packed_sequence_indices", "sdpa_mask"):
        real = getattr(masking, name)
        monkeypatch.setattr(masking, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    hf_backend.capture(packed(make_request([5, 6, 3]), 16))
    assert calls == []  # transformers' packed-sample search reads the positions back from the device
    hf_backend.capture(make_request([5, 3]))
    assert "sdpa_mask" in calls  # the padded capture after it still builds its mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (sync debug mode, FlashAttention varlen)")
def test_a_packed_capture_never_waits_for_the_device(tiny_qwen3_dir):
    cfg = load_config(None, [f"model.target={tiny_qwen3_dir}", "capture.device=cuda", "data.max_length=256",
                             "model.dtype=bfloat16"])
    backend = HFCaptureBackend.from_config(cfg, device=torch.device("cuda"))
    request = packed(make_request([5, 6, 3]), 16)
    backend.capture(request)  # warm-up: first calls initialise kernels and caches
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = backend.capture(request)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert batch.host_masks is not None and batch.aux_hidden.is_cuda
