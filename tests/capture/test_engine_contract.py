"""The fake SGLang engine and the real seam keep one contract: the same start signature, and one
scripted scenario gives the same result through the fake and through the real seam's pure parts
(the parts of ``capture/sglang_engine.py`` that run without SGLang): pools SGLang sized too small
refused at start, a request its pools cannot hold refused, this rank's rows when ``local.start``
is None, and capture ids asked out of order.
"""

import inspect

import pytest
import torch

from fixtures.fake_sglang import FakeSGLangEngine
from specforge_core.capture.sglang_backend import SGLangEngineArgs, check_engine_pools, check_engine_request
from specforge_core.capture.sglang_engine import ModelRunnerEngine, pack_local
from specforge_core.config import load_config
from specforge_core.errors import CaptureError
from specforge_core.run.topology import Topology

UNSORTED_IDS = (5, 1, 3)  # the tiny target has 8 layers
ROWS = [[7, 8, 9, 10], [11, 12], [13, 14, 15]]


def engine_args(model_dir):
    cfg = load_config(None, [f"model.target={model_dir}", "capture.backend=sglang", "capture.device=auto",
                             "data.max_length=16", "model.dtype=float32", "training.batch_size=3"])
    topology = Topology.from_config(cfg)
    return SGLangEngineArgs.resolve(cfg, topology), topology


def start_fake(model_dir):
    args, topology = engine_args(model_dir)
    return FakeSGLangEngine.start(args, UNSORTED_IDS, place=topology.place(0), device=torch.device("cpu"),
                                  islands=topology.islands())


def test_the_fake_and_the_real_engine_start_with_one_signature():
    fake, real = (inspect.signature(e.start).replace(return_annotation=None) for e in (FakeSGLangEngine, ModelRunnerEngine))
    assert fake == real
    assert (inspect.signature(FakeSGLangEngine.capture).parameters.keys()
            == inspect.signature(ModelRunnerEngine.capture).parameters.keys())


def test_pools_sized_below_one_batch_are_refused_at_start_by_both(tiny_target_dir, monkeypatch):
    args, _ = engine_args(tiny_target_dir)
    rows, tokens = args.get("max_running_requests"), args.get("max_total_tokens")
    # the real seam: check_engine_pools on the pools SGLang allocated, with the arguments it asked for
    with pytest.raises(CaptureError) as real:
        check_engine_pools(rows=rows - 1, tokens=tokens, need_rows=rows, need_tokens=tokens, where="sglang engine")
    monkeypatch.setattr(FakeSGLangEngine, "pool_cap", (rows - 1, tokens))
    with pytest.raises(CaptureError) as fake:
        start_fake(tiny_target_dir)
    assert str(fake.value).split("\n")[0].split(": ", 1)[-1] == str(real.value).split("\n")[0].split(": ", 1)[-1]
    assert fake.value.fix == real.value.fix


def test_a_request_past_the_pools_is_refused_alike(tiny_target_dir):
    engine = start_fake(tiny_target_dir)
    too_many = ROWS + [[16, 17]]
    with pytest.raises(CaptureError) as fake:
        engine.capture(too_many, slice(None, 2))
    with pytest.raises(CaptureError) as real:  # the real engine checks against its runner's pools: the same sizes
        check_engine_request(too_many, context_len=engine.context_len, max_rows=engine.max_rows,
                             max_tokens=engine.max_tokens, where="sglang engine")
    assert fake.value.fix == real.value.fix and "request slots" in str(fake.value)


@pytest.mark.parametrize("local", [slice(None, 2), slice(1, 3), slice(2, None)], ids=["start-None", "middle", "stop-None"])
def test_rows_and_unsorted_capture_ids_come_back_alike(tiny_target_dir, local):
    from transformers import AutoModelForCausalLM

    fake = start_fake(tiny_target_dir).capture(ROWS, local)
    # what SGLang hands the real seam: every row token-packed, aux states in ascending layer order
    decoder = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval().get_decoder()
    with torch.inference_mode():
        outs = [decoder(input_ids=torch.tensor([row]), output_hidden_states=True) for row in ROWS]
    aux = [torch.cat([o.hidden_states[i + 1][0] for o in outs]) for i in sorted(UNSORTED_IDS)]
    last = torch.cat([o.last_hidden_state[0] for o in outs])
    real = pack_local(aux, last, [len(r) for r in ROWS], local, UNSORTED_IDS)
    assert fake.lengths == real.lengths == [len(r) for r in ROWS][local]
    torch.testing.assert_close(fake.aux, real.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fake.last, real.last, rtol=1e-5, atol=1e-5)
