"""``draft.lm_head_init``: a fresh EAGLE3 draft may start its lm_head from the target's rows."""

import pytest
import torch

from specforge_core.config import load_config
from specforge_core.drafts import check_config, get_family
from specforge_core.launch.builder import build_draft
from tests.drafts.eagle3.fixtures import hf_backend, random_vocab_map


@pytest.mark.parametrize("init", ["random", "target"])
def test_a_fresh_draft_starts_its_lm_head_from_the_targets_draft_vocab_rows_only_when_asked(tiny_target_dir, init):
    backend = hf_backend(tiny_target_dir)
    vocab = random_vocab_map(backend.vocab_size, 64)
    cfg = load_config(None, [f"model.target={tiny_target_dir}", "draft.draft_vocab_size=64", f"draft.lm_head_init={init}"])
    draft = build_draft(cfg, get_family("eagle3"), backend, vocab)
    rows = backend.lm_head_weight[vocab.d2t + torch.arange(64)]
    assert torch.equal(draft.lm_head.weight, rows) == (init == "target")
    assert draft.lm_head.weight.requires_grad  # trained from there


def test_lm_head_init_is_refused_for_a_dflash_draft_naming_the_field():
    from specforge_core.errors import ConfigError

    with pytest.raises(ConfigError, match="draft.lm_head_init"):
        check_config(load_config(None, ["draft.family=dflash", "draft.lm_head_init=target"]))


def test_a_target_head_of_another_width_is_refused_naming_the_setting(tiny_target_dir):
    from specforge_core.drafts.eagle3.model import Eagle3DraftModel
    from specforge_core.errors import ModelError
    from tests.drafts.eagle3.fixtures import tiny_draft

    draft: Eagle3DraftModel = tiny_draft(seed=0)
    with pytest.raises(ModelError, match="lm_head_init"):
        draft.load_lm_head_from_target(torch.zeros(draft.config.vocab_size, draft.lm_head.in_features + 1))


def test_a_fresh_draft_skips_the_embedding_draw_and_takes_the_targets(tiny_target_dir):
    """new_draft leaves the [V, H] embedding at zeros (no random draw: ≈ 10 s at a 152k vocabulary);
    the builder copies the target's in; a draft built directly still draws it."""
    from specforge_core.drafts.eagle3.model import Eagle3DraftModel

    family = get_family("eagle3")
    backend = hf_backend(tiny_target_dir)
    cfg = load_config(None, [f"model.target={tiny_target_dir}", "draft.draft_vocab_size=64"])
    config = family.draft_config(cfg, backend.target_config, backend.layer_ids)
    fresh = family.new_draft(config)
    assert not fresh.embed_tokens.weight.any() and fresh.fc.weight.std() > 0
    assert Eagle3DraftModel(config).embed_tokens.weight.std() > 0
    draft = build_draft(cfg, family, backend, random_vocab_map(backend.vocab_size, 64))
    assert torch.equal(draft.embed_tokens.weight, backend.embed_weight.float())
    assert not draft.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_fresh_draft_is_built_on_the_targets_device_with_its_embedding_map_and_head(tiny_target_dir, device):
    """The builder draws a fresh draft where the target lives (no CPU draw and copy on a GPU); the
    target's embedding, the vocab map and the lm_head rows still go in."""
    family = get_family("eagle3")
    backend = hf_backend(tiny_target_dir, device)
    vocab = random_vocab_map(backend.vocab_size, 64)
    cfg = load_config(None, [f"model.target={tiny_target_dir}", "draft.draft_vocab_size=64", "draft.lm_head_init=target"])
    draft = build_draft(cfg, family, backend, vocab)
    assert {t.device.type for t in [*draft.parameters(), *draft.buffers()]} == {device}
    assert torch.equal(draft.embed_tokens.weight, backend.embed_weight.float())
    assert torch.equal(draft.d2t.cpu(), vocab.d2t) and torch.equal(draft.t2d.cpu(), vocab.t2d)
    assert torch.equal(draft.lm_head.weight, backend.lm_head_weight[vocab.d2t.to(device) + torch.arange(64, device=device)])
    assert draft.fc.weight.std() > 0  # drawn, not left empty
