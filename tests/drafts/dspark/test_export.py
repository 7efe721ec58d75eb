"""DSpark files: our export reloads bit-identically and a warm start refuses other settings; the
``--format speculators`` export loads in speculators 0.9.0 as its DSparkDraftModel, with every
weight ours and the same loss on a batch."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from specforge_core.drafts.dspark.architecture import DSparkDraftModel
from specforge_core.drafts.dspark.files import export_dspark, load_exported_dspark, save_dspark_checkpoint_files
from specforge_core.drafts.dspark.files import warm_start_dspark
from specforge_core.drafts.dspark.objective import ObjectiveSettings, draft_slots, dspark_loss
from specforge_core.drafts.dspark.settings import dspark_config_from_target
from specforge_core.errors import ModelError
from specforge_core.export import main
from tests.drafts.dspark.fixtures import randomize, tiny_dspark

BLOCK = 4


def test_our_export_reloads_every_tensor_and_refuses_a_mismatched_warm_start(tmp_path):
    draft = tiny_dspark(1, markov_head_type="gated")
    out = export_dspark(draft, tmp_path / "export", dtype="bfloat16")
    again = load_exported_dspark(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]  # SGLang's and vLLM's class
    # SGLang reads the head fields from dspark_config, vLLM (and SGLang's confidence head) at the top level
    assert config["dspark_config"]["markov_head_type"] == config["markov_head_type"] == "gated"
    assert config["enable_confidence_head"] and config["dflash_config"]["mask_token_id"] == 255
    mine = {k: v.to(torch.bfloat16) for k, v in draft.draft_state_dict().items()}
    assert mine.keys() == again.draft_state_dict().keys()
    assert all(torch.equal(mine[k], again.draft_state_dict()[k]) for k in mine)
    other = tiny_dspark(1, markov_head_type="rnn").config
    with pytest.raises(ModelError, match="dspark_config.markov_head_type"):
        warm_start_dspark(out, other)


def test_a_misnamed_tensor_is_refused_before_writing(tmp_path):
    draft = tiny_dspark(2)
    state = draft.draft_state_dict()
    state["markov_head.w1"] = state.pop("markov_head.markov_w1.weight")
    with pytest.raises(ModelError, match="missing markov_head.markov_w1.weight"):
        export_dspark(draft, tmp_path / "bad", state_dict=state)
    assert not (tmp_path / "bad").exists()


def test_speculators_loads_the_export_and_computes_our_loss(tmp_path, tiny_target_dir, capsys):
    from speculators import SpeculatorModel
    from speculators.models.dspark import DSparkDraftModel as TheirDSpark

    from tests.drafts.dspark.speculators_reference import run_reference, use_eager_attention

    target_config = AutoConfig.from_pretrained(tiny_target_dir)
    config = dspark_config_from_target(target_config, block_size=BLOCK, num_layers=1, target_layer_ids=[1, 4],
                                       mask_token_id=3, markov_rank=16)
    draft = randomize(DSparkDraftModel(config), 3)
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    save_dspark_checkpoint_files(draft, step)
    (step.parent / "latest").write_text(step.name + "\n")
    out = tmp_path / "speculators"
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--format", "speculators",
                 "--target", str(tiny_target_dir)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["vllm_layer_ids"] == [2, 5] and line["speculative_tokens"] == BLOCK
    assert line["keys"] == len(draft.draft_state_dict())  # no embedding rides along

    model = SpeculatorModel.from_pretrained(out)
    assert type(model) is TheirDSpark
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in draft.draft_state_dict().items())
    target = load_file(str(tiny_target_dir / "model.safetensors"))
    assert torch.equal(loaded["verifier_lm_head.weight"], target["lm_head.weight"])

    # the loaded model, run as the parity test runs it, computes our loss
    use_eager_attention(model)
    g = torch.Generator().manual_seed(4)
    n, hidden = 30, target_config.hidden_size
    pre = torch.randn(1, n, hidden, generator=g)
    norm = target["model.norm.weight"]
    last = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + target_config.rms_norm_eps) * norm
    lm = torch.ones(1, n, dtype=torch.long)
    lm[0, -BLOCK:] = 0
    batch = {"input_ids": torch.randint(4, 200, (1, n), generator=g), "attention_mask": torch.ones(1, n, dtype=torch.long),
             "loss_mask": lm, "aux_hidden": torch.randn(1, n, 2 * hidden, generator=g), "last_hidden": last}
    kwargs = dict(embed_weight=target["model.embed_tokens.weight"], lm_head_weight=target["lm_head.weight"],
                  num_anchors=5, backend="sdpa")
    slots = draft_slots(draft, batch, generator=torch.Generator().manual_seed(0), **kwargs)
    loss, sums = dspark_loss(draft, batch, settings=ObjectiveSettings(), generator=torch.Generator().manual_seed(0),
                             **kwargs)
    anchors = slots.blocks.anchor_col[slots.blocks.keep]
    pad = torch.zeros(1, BLOCK, dtype=torch.long)
    ref_loss, _, _ = run_reference(
        model, anchors, aux=torch.cat([batch["aux_hidden"], torch.zeros(1, BLOCK, 2 * hidden)], 1),
        input_ids=torch.cat([batch["input_ids"], pad], 1), loss_mask=torch.cat([lm, pad], 1),
        pre_norm_last=torch.cat([pre, torch.zeros(1, BLOCK, hidden)], 1),
        document_ids=torch.cat([torch.zeros(1, n, dtype=torch.long), pad - 1], 1),
        position_ids=torch.arange(n + BLOCK)[None], loss_terms={"kl_div": 1.0}, gamma=4.0)
    torch.testing.assert_close(loss.detach().double() / sums["weight_sum"], ref_loss.double(), rtol=1e-5, atol=0)
