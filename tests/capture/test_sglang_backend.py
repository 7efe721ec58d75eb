"""The sglang backend over the fake engine: same numbers as hf, TP-wide capture cut into slices."""

import pytest
import torch

from specforge_core.capture import build_capture_backend
from fixtures.fake_sglang import FakeSGLangEngine
from specforge_core.capture.hf import HFCaptureBackend
from specforge_core.capture.sglang_backend import PackedCapture, SGLangCaptureBackend
from specforge_core.config import load_config
from specforge_core.errors import CaptureError
from specforge_core.run.topology import Topology

from .conftest import make_request


def sglang_config(model_dir, *overrides):
    return load_config(None, [
        f"model.target={model_dir}", "capture.backend=sglang", "capture.device=auto", "data.max_length=256",
        "model.dtype=float32", "training.batch_size=4", *overrides,
    ])


def sglang_backend(model_dir, rank=0, tp_size=1, engine_factory=FakeSGLangEngine.start):
    cfg = sglang_config(model_dir, f"capture.tp_size={tp_size}", f"deployment.nproc_per_node={tp_size}")
    return build_capture_backend(cfg, rank=rank, topology=Topology.from_config(cfg), engine_factory=engine_factory)


@pytest.fixture(scope="module")
def hf(tiny_target_dir):
    cfg = load_config(None, [f"model.target={tiny_target_dir}", "capture.device=cpu", "data.max_length=256"])
    return HFCaptureBackend.from_config(cfg, device=torch.device("cpu"))


def test_sglang_backend_on_the_fake_engine_matches_the_hf_backend(tiny_target_dir, hf):
    req = make_request([5, 9, 2])
    got, want = sglang_backend(tiny_target_dir).capture(req), hf.capture(req)
    torch.testing.assert_close(got.aux_hidden, want.aux_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.last_hidden, want.last_hidden, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)


def test_head_weights_come_from_the_checkpoint(tiny_target_dir, hf):
    backend = sglang_backend(tiny_target_dir)
    assert torch.equal(backend.lm_head_weight, hf.lm_head_weight)
    assert torch.equal(backend.embed_weight, hf.embed_weight)
    assert (backend.vocab_size, backend.hidden_size) == (hf.vocab_size, hf.hidden_size)


def test_tied_checkpoint_head_is_the_embedding(tiny_tied_dir):
    backend = sglang_backend(tiny_tied_dir)
    assert torch.equal(backend.lm_head_weight, backend.embed_weight)


def test_tp_peers_each_get_their_slice_of_one_tp_wide_capture(tiny_target_dir, hf):
    peers = [sglang_backend(tiny_target_dir, rank=r, tp_size=2) for r in range(2)]
    rows = [4, 10, 6, 3]
    slices = [peer.capture(make_request(rows, local=slice(2 * r, 2 * r + 2))) for r, peer in enumerate(peers)]
    full = hf.capture(make_request(rows))
    for r, got in enumerate(slices):
        width = max(rows[2 * r : 2 * r + 2])
        torch.testing.assert_close(got.aux_hidden, full.aux_hidden[2 * r : 2 * r + 2, :width], rtol=1e-4, atol=1e-4)
    assert [p.engine.rows_computed for p in peers] == [4, 4]  # each peer took part in the whole batch
    assert [p.engine.tp_rank for p in peers] == [0, 1]


def test_kept_rows_are_copies_not_views_of_the_engine_buffer(tiny_target_dir):
    batch = sglang_backend(tiny_target_dir, tp_size=2).capture(make_request([8, 8, 8, 8], local=slice(0, 2)))
    for t in (batch.aux_hidden, batch.last_hidden):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert not t.is_inference()


class TruncatingEngine(FakeSGLangEngine):
    """An engine that loses the last token of this rank's last row."""

    def capture(self, input_ids, local):
        p = super().capture(input_ids, local)
        return PackedCapture(p.aux[:-1], p.last[:-1], [*p.lengths[:-1], p.lengths[-1] - 1])


def test_a_partial_engine_capture_raises(tiny_target_dir):
    backend = sglang_backend(tiny_target_dir, engine_factory=TruncatingEngine.start)
    with pytest.raises(CaptureError, match="partial capture"):
        backend.capture(make_request([5, 6]))


def test_close_shuts_the_engine_down(tiny_target_dir):
    backend = sglang_backend(tiny_target_dir)
    backend.close()
    assert backend.engine.closed


def test_the_backend_holds_what_the_hf_backend_holds_for_every_capture_backend_member(tiny_target_dir, hf):
    """An isinstance check against the runtime-checkable Protocol only sees that the names exist."""
    import inspect

    from specforge_core.capture.base import CaptureBackend

    backend = sglang_backend(tiny_target_dir)
    assert (backend.name, hf.name) == ("sglang", "hf")
    for member in ("layer_ids", "hidden_size", "vocab_size", "device"):
        assert getattr(backend, member) == getattr(hf, member), member
    for member in ("lm_head_weight", "embed_weight"):
        assert torch.equal(getattr(backend, member), getattr(hf, member)), member
    for method in ("capture", "close"):
        assert (inspect.signature(getattr(backend, method)).parameters.keys()
                == inspect.signature(getattr(CaptureBackend, method)).parameters.keys() - {"self"}), method
    backend.close()
    assert backend.engine.closed
