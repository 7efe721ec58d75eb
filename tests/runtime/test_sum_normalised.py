"""A loss that is a sum (DFlash's Σ w·ℓ) trains the global weighted mean, however it is split.

Two ranks × two micro-batches, each micro-batch holding a different share of the weight, end with
the weights of one process that trains Σ w·ℓ / Σ w over the whole batch of every step.
"""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch import nn

from specforge_core.system.distributed import close_distributed, init_distributed
from specforge_core.loop.optim import DraftOptimizer, shard
from specforge_core.loop.trainer import sum_loss_grad_scale
from tests.runtime.harness import TinyDraft, run_ranks

STEPS, HYPER = 3, dict(learning_rate=1e-2, weight_decay=0.0, max_grad_norm=10.0, warmup_ratio=0.0, lr_scheduler="constant")


class SumStep(nn.Module):
    """Σ w·CE of a one-step unroll: per position weights ``w`` (some zero), hard labels."""

    def __init__(self, draft: TinyDraft):
        super().__init__()
        self.draft = draft

    def forward(self, batch: dict):
        d = self.draft
        h = d.advance(d.embed_tokens(batch["ids"]), d.fc(batch["aux"]))
        ce = nn.functional.cross_entropy(d.lm_head(d.norm(h)).flatten(0, 1), batch["label"].flatten(),
                                         reduction="none")
        return (ce * batch["weight"].flatten()).sum(), batch["weight"].sum()


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(8, 5, generator=g) * (torch.rand(8, 5, generator=g) > 0.3)
    weight[:2] *= 5  # the first micro-batch carries far more weight than the others
    return {"ids": torch.randint(32, (8, 5), generator=g), "aux": torch.randn(8, 5, 24, generator=g),
            "label": torch.randint(12, (8, 5), generator=g), "weight": weight}


def _worker(rank):
    d = init_distributed("cpu", timeout_s=30)
    torch.manual_seed(0)
    draft = TinyDraft()
    root = shard(SumStep(draft), d)
    opt = DraftOptimizer(root, accumulation_steps=2, total_steps=STEPS, **HYPER)
    norms = []
    for s in range(STEPS):
        chunks = {k: v.chunk(4) for k, v in batch(s).items()}
        local = torch.zeros((), dtype=torch.float64, device=d.device)
        for m in range(2):
            loss, weight = root({k: c[m * 2 + d.rank] for k, c in chunks.items()})
            opt.backward(loss)
            local = local + weight.detach()  # on the device, as the trainer keeps it
        norms.append(float(opt.step(sum_loss_grad_scale(d, local, 2))["grad_norm"]))
    # a window without weight on any rank: no update (scale 0), still a device scalar
    empty = sum_loss_grad_scale(d, torch.zeros((), dtype=torch.float64, device=d.device), 2)
    weights = get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    close_distributed()
    return weights, norms, (float(empty), empty.device.type, empty.dtype)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    draft = TinyDraft()
    step = SumStep(draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=HYPER["learning_rate"], weight_decay=0.0)
    norms = []
    for s in range(STEPS):
        loss, weight = step(batch(s))
        (loss / weight).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, HYPER["max_grad_norm"])))
        opt.step()
        opt.zero_grad()
    return draft.state_dict(), norms


def test_two_ranks_and_two_micro_steps_train_the_global_weighted_mean(reference):
    (got, got_norms, empty), (want, want_norms) = run_ranks(_worker, 2)[0], reference
    assert empty == (0.0, "cpu", torch.float32)
    # the gradient itself (its norm before clipping), not only the update AdamW makes of it
    assert got_norms == pytest.approx(want_norms, rel=1e-5)
    for k in [k for k in want if k != "embed_tokens.weight"]:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    # the per-micro-batch mean would differ: the split carries unequal weight
    assert batch(0)["weight"][:2].sum() > 2 * batch(0)["weight"][2:4].sum()
