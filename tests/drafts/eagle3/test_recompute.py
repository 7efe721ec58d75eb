"""training.activation_checkpointing: each unrolled step's MLP block recomputed in backward gives
the same loss and gradients, keeps less for backward (at least what the dry run counts it saves),
and reaches the draft through the builder."""

import copy

import pytest
import torch

from specforge_core.config import load_config
from specforge_core.drafts.eagle3.objective import eagle3_loss
from specforge_core.system.recompute import recompute_regions
from tests.drafts.eagle3.fixtures import random_batch, target_head, tiny_draft

TARGET_HIDDEN = 24


def saved_bytes_and_grads(draft, batch, head):
    """The loss, the bytes the forward saved for backward (distinct storages), the gradients."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = eagle3_loss(draft, batch, head, ttt_length=4, backend="sdpa", compile=False)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return loss.detach(), sum(seen.values()), grads


def test_recomputing_the_mlp_block_keeps_the_loss_and_gradients_and_saves_what_the_dry_run_counts():
    batch = random_batch(3, [20, 14, 9], 20, TARGET_HIDDEN)
    head = target_head(3, TARGET_HIDDEN)
    plain = tiny_draft(seed=5)
    rows = []
    complete = plain.midlayer.complete

    def counting(hidden, attn):  # the rows each step's MLP block runs on
        rows.append(hidden.shape[1])
        return complete(hidden, attn)

    plain.midlayer.complete = counting
    recomputed = copy.deepcopy(tiny_draft(seed=5))
    assert recompute_regions(recomputed) == 1  # the decoder layer's MLP block

    loss_a, saved_a, grads_a = saved_bytes_and_grads(plain, batch, head)
    loss_b, saved_b, grads_b = saved_bytes_and_grads(recomputed, batch, head)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7, msg=name)
    config = plain.config
    h, i = config.hidden_size, config.intermediate_size
    counted = (2 * h + 3 * i) * 4 * sum(rows)  # the dry run's saving (EAGLE3 activation_bytes), fp32 here
    assert len(rows) == 4 and saved_a - saved_b >= counted


@pytest.mark.parametrize("family, refused", [("eagle3", False), ("dflash", True), ("dspark", True)])
def test_the_switch_is_eagle3s(family, refused):
    from specforge_core.drafts import check_config
    from specforge_core.errors import ConfigError

    cfg = load_config(None, [f"draft.family={family}", "training.activation_checkpointing=true"])
    if not refused:
        check_config(cfg)
        return
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert err.value.where == "training.activation_checkpointing"


@pytest.mark.parametrize("switch", [False, True])
def test_the_builder_checkpoints_the_drafts_regions_only_when_asked(tiny_target_dir, switch):
    from specforge_core.drafts import get_family
    from specforge_core.launch.builder import build_draft
    from tests.drafts.eagle3.fixtures import hf_backend, random_vocab_map

    backend = hf_backend(tiny_target_dir)
    cfg = load_config(None, [f"model.target={tiny_target_dir}", "draft.draft_vocab_size=64",
                             f"training.activation_checkpointing={str(switch).lower()}"])
    draft = build_draft(cfg, get_family("eagle3"), backend, random_vocab_map(backend.vocab_size, 64))
    assert getattr(draft.midlayer.complete, "recomputed", False) == switch
