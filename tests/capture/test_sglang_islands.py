"""SGLang capture with islands inside a larger world, on the CPU through the fake engine.

Four gloo ranks, two islands of tp 2: every rank starts its engine at the same point (the island
groups are built collectively), the TP peers of an island capture one TP-wide batch in lockstep
and keep disjoint rows, and what each rank keeps equals the hf backend's capture of the same rows.
Peers asked for different batches fail, naming the digests, instead of hanging.
"""

import pytest
import torch

from fixtures.fake_sglang import FakeSGLangEngine
from specforge_core.capture import build_capture_backend
from specforge_core.capture.hf import HFCaptureBackend
from specforge_core.config import load_config
from specforge_core.errors import CaptureError
from specforge_core.run.plan import PromptPlan
from specforge_core.run.topology import Topology
from specforge_core.loop.rollout import RolloutStream
from tests.runtime.harness import run_ranks


def _config(model_dir):
    return load_config(None, [f"model.target={model_dir}", "capture.backend=sglang", "capture.tp_size=2",
                              "deployment.nproc_per_node=4", "training.batch_size=2", "data.max_length=64",
                              "model.dtype=float32"])


def _rows(n=16):
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(3, 500, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist(),
             "loss_mask": [1] * 20} for _ in range(n)]


def _fix_masks(rows):
    return [{**r, "loss_mask": r["loss_mask"][: len(r["input_ids"])]} for r in rows]


def _capture(rank, cfg, topology, mismatched):
    """One capture pass over the plan on this rank: what it kept, or the CaptureError's message."""
    backend = build_capture_backend(cfg, rank=rank, topology=topology, engine_factory=FakeSGLangEngine.start)
    rows = _fix_masks(_rows())
    if mismatched and rank == 1:
        rows = list(reversed(rows))  # this peer reads another batch than its island partner
    plan = PromptPlan.from_config(cfg, len(rows), topology=topology)
    out = []
    try:
        for batch in RolloutStream.from_plan(plan, rank, rows, backend):
            out.append({"task_ids": batch.task_ids, "aux": batch.aux_hidden, "mask": batch.attention_mask})
            del batch
    except CaptureError as e:
        out = str(e)
    finally:
        backend.close()
    return {"place": topology.place(rank), "batches": out, "calls": backend.engine.forward_calls}


def _capture_worker(rank, model_dir):
    """Both passes in one launch of the 4 ranks (starting them is most of the cost): the peers asked
    for the same batches, then, with new engines, the peers of island 0 asked for different ones."""
    from specforge_core.system.distributed import close_distributed, init_distributed

    init_distributed("cpu", timeout_s=60)
    cfg = _config(model_dir)
    topology = Topology.from_config(cfg, world_size=4)
    try:
        return {"matched": _capture(rank, cfg, topology, False), "mismatched": _capture(rank, cfg, topology, True)}
    finally:
        close_distributed()


@pytest.fixture(scope="module")
def launch(tiny_target_dir):
    return run_ranks(_capture_worker, 4, str(tiny_target_dir), timeout_s=120)


@pytest.fixture(scope="module")
def ranks(launch):
    return [r["matched"] for r in launch]


def test_each_island_captures_its_own_shard_and_each_peer_keeps_disjoint_rows(ranks):
    tasks = {r["place"].rank: [t for b in r["batches"] for t in b["task_ids"]] for r in ranks}
    every = [t for ids in tasks.values() for t in ids]
    assert len(every) == len(set(every)) == 16  # every prompt once, on one rank
    assert {t.split("-")[0] for t in tasks[0] + tasks[1]} == {"island0000"}
    assert {t.split("-")[0] for t in tasks[2] + tasks[3]} == {"island0001"}
    assert all(r["calls"] == len(r["batches"]) for r in ranks)  # one lockstep capture per micro-step


def test_what_each_rank_keeps_equals_the_hf_capture_of_the_same_rows(ranks, tiny_target_dir):
    cfg = load_config(None, [f"model.target={tiny_target_dir}", "capture.device=cpu", "data.max_length=64",
                             "model.dtype=float32"])
    hf = HFCaptureBackend.from_config(cfg, device=torch.device("cpu"))
    rows = _fix_masks(_rows())
    for r in ranks:
        for b in r["batches"]:
            for i, task in enumerate(b["task_ids"]):
                ids = rows[int(task.split("prompt")[1])]["input_ids"]
                with torch.inference_mode():
                    hidden = hf.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
                want = torch.cat([hidden[k + 1][0] for k in hf.layer_ids], -1)
                torch.testing.assert_close(b["aux"][i, : len(ids)], want, rtol=1e-4, atol=1e-4)


def test_peers_asked_for_different_batches_fail_naming_the_digests(launch):
    results = [r["mismatched"] for r in launch]
    island0 = [r["batches"] for r in results if r["place"].island == 0]
    assert all(isinstance(b, str) and "TP peers were asked to capture different batches" in b for b in island0)
    assert all(isinstance(r["batches"], list) for r in results if r["place"].island == 1)
