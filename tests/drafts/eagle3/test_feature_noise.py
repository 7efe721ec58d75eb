"""``training.feature_noise``: EAGLE-1's feature noise on the draft's input features, relative to
each captured layer's scale, EAGLE3 only, part of the resume contract when set."""

import pytest
import torch

from specforge_core.config import load_config
from specforge_core.drafts import check_config, get_family
from specforge_core.drafts.eagle3.objective import noisy_features


def _features(seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 6, 3 * 8, generator=g)
    aux[..., 16:] *= 100  # a deep layer's states are far larger than the first's
    aux[1, 4:] = 0  # padding
    return aux


def test_noise_is_bounded_per_layer_by_its_own_scale_and_leaves_padding_and_the_input_alone():
    aux = _features()
    before = aux.clone()
    torch.manual_seed(0)
    noisy = noisy_features(aux, 3, 0.1)
    assert torch.equal(aux, before)  # a new tensor
    x, n = aux.unflatten(-1, (3, 8)), noisy.unflatten(-1, (3, 8))
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    deviation = (n - x).abs()
    assert (deviation <= 0.1 * rms + 1e-6).all()
    assert (deviation[:, :, :2].amax() < 1) and (deviation[:, :, 2].amax() > 1)  # each layer's own scale
    assert (deviation > 0.01 * rms)[0].float().mean() > 0.8  # it does perturb, not just bound
    assert torch.equal(noisy[1, 4:], aux[1, 4:])


def test_the_objective_trains_on_noisy_features_only_when_asked_and_reproducibly(tiny_target_dir):
    """Built the way the trainer builds it: the family's objective from the run config."""
    from specforge_core.launch.builder import build_draft, build_objective
    from tests.drafts.eagle3.fixtures import hf_backend, random_batch, random_vocab_map

    family = get_family("eagle3")
    backend = hf_backend(tiny_target_dir)
    vocab = random_vocab_map(backend.vocab_size, 64)
    losses = {}
    for noise in (0.0, 0.5):
        cfg = load_config(None, [f"model.target={tiny_target_dir}", "draft.draft_vocab_size=64",
                                 "training.ttt_length=3", f"training.feature_noise={noise}"])
        draft = build_draft(cfg, family, backend, vocab)
        objective, _ = build_objective(cfg, family, backend)
        batch = random_batch(1, [10, 7], 10, backend.hidden_size, vocab=backend.vocab_size)
        runs = []
        for _ in range(2):
            torch.manual_seed(3)
            runs.append(objective(draft, batch)[0].item())
        assert runs[0] == runs[1]
        losses[noise] = runs[0]
        torch.manual_seed(4)
        other_seed = objective(draft, batch)[0].item()
        assert (other_seed != runs[0]) == bool(noise)  # the noise is drawn, the plain loss is not
    assert losses[0.0] != losses[0.5]


def test_feature_noise_joins_the_resume_contract_only_when_set():
    family = get_family("eagle3")
    assert family.contract_fields(load_config(None, [])) == {}
    assert family.contract_fields(load_config(None, ["training.feature_noise=0.1"])) == {"feature_noise": 0.1}


@pytest.mark.parametrize("override, match", [
    (["draft.family=dflash", "training.feature_noise=0.1"], "training.feature_noise"),
    (["training.feature_noise=-0.1"], "feature_noise"),
])
def test_feature_noise_is_refused_where_it_means_nothing_naming_the_field(override, match):
    from specforge_core.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        check_config(load_config(None, override))
