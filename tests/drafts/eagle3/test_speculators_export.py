"""The speculators export, loaded by the real ``speculators`` package (``make install`` installs
0.9.0 without its GPU dependencies): the config it parses, the weights it maps, the logits of its
own forward, and the export command's refusals."""

import json

import pytest
import torch
from safetensors import safe_open
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.models.attention import create_float_mask
from speculators.models.eagle3 import Eagle3DraftModel as SpeculatorsEagle3, Eagle3SpeculatorConfig
from transformers import AutoConfig, LlamaConfig

from specforge_core.drafts.eagle3.draft_config import capture_layer_ids_of, draft_config_from_target
from specforge_core.drafts.eagle3.model import Eagle3DraftModel
from specforge_core.drafts.eagle3.serving import save_draft_checkpoint_files
from specforge_core.drafts.eagle3.speculators_format import speculators_key
from specforge_core.export import main

VD = 48


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _draft(target_dir, capture_ids=None, fc_norm=False, norm_output=False, seed=0, vd=VD) -> Eagle3DraftModel:
    """A draft for the tiny target with weights far from init (so a wrong mapping shows) and a random vocab map."""
    config = draft_config_from_target(AutoConfig.from_pretrained(target_dir), vd, capture_layer_ids=capture_ids,
                                      fc_norm=fc_norm, norm_output=norm_output)
    draft = Eagle3DraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(config.vocab_size, generator=g)[:vd]] = True
    draft.set_vocab_map(torch.nonzero(t2d).flatten() - torch.arange(vd), t2d)
    draft.load_embedding(_tensors(target_dir / "model.safetensors")["model.embed_tokens.weight"])
    return draft


def _export(tmp_path, target_dir, draft, *extra) -> tuple:
    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    save_draft_checkpoint_files(draft, step)
    (step.parent / "latest").write_text(step.name + "\n")
    out = tmp_path / "vllm"
    code = main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--format", "speculators",
                 "--target", str(target_dir), *extra])
    return code, out


def _step0_logits_ours(draft, aux, ids, positions):
    with torch.no_grad():
        hidden, _ = draft.step(ids, draft.project_hidden(aux), positions)
        return draft.compute_logits(hidden)


def _step0_logits_speculators(model, aux, ids, positions):
    return _ttt_logits_speculators(model, aux, ids, positions, steps=1)[0]


def _eager_attention(model) -> None:
    """speculators' dense attention path: its flex block mask does not extend below 128 rows."""
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    model.config.transformer_layer_config._attn_implementation = "eager"


def _smollm2_forward(smollm2_dir):
    """``(target, ids, out, pre_norm)``: SmolLM2-135M-Instruct in fp32 on one sentence, its outputs
    with every layer's hidden states, and the last hidden before the final norm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    text = "Speculative decoding drafts a few tokens cheaply and lets the target verify them at once."
    ids = AutoTokenizer.from_pretrained(smollm2_dir)(text, return_tensors="pt").input_ids
    pre_norm = []
    hook = target.model.norm.register_forward_hook(lambda _m, inputs, _o: pre_norm.append(inputs[0]))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    hook.remove()
    return target, ids, out, pre_norm[0]


def _ttt_logits_speculators(model, aux, ids, positions, steps):
    """Each TTT step's logits ``[1, T, Vd]`` of speculators' own training forward (teacher forcing:
    step k reads ``ids`` shifted k to the left, zero-filled, at positions + k)."""
    if steps > 1:
        _eager_attention(model)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=positions,
                  ttt_steps=steps)
    finally:
        hook.remove()
    return seen


def _ttt_logits_ours(draft, aux, ids, positions, steps):
    """The same unroll through our decoding ``step``: step k's row t sees the step-0 rows up to t
    and its own position's rows of steps 1..k, and carries ``carry`` of step k-1's output."""
    t = ids.shape[1]
    causal, eye = torch.ones(t, t, dtype=torch.bool).tril(), torch.eye(t, dtype=torch.bool)
    hidden, cache, out = draft.project_hidden(aux), None, []
    with torch.no_grad():
        for k in range(steps):
            step_ids = torch.cat([ids[:, k:], ids.new_zeros(1, k)], dim=1)
            mask = torch.cat([causal] + [eye] * k, dim=1)[None]
            hidden, (key, value) = draft.step(step_ids, hidden, positions + k, past_key_values=cache,
                                              attention_mask=mask)
            cache = (key, value) if cache is None else (torch.cat([cache[0], key], 2), torch.cat([cache[1], value], 2))
            out.append(draft.compute_logits(hidden))
    return out


CASES = {"default ids": ({}, []), "custom ids": ({"capture_ids": [0, 2, 6]}, []),
         "fc_norm": ({"fc_norm": True}, []), "eagle31": ({"fc_norm": True, "norm_output": True}, []),
         "bf16": ({}, ["--dtype", "bfloat16"])}


@pytest.mark.parametrize("case", CASES)
def test_speculators_parses_the_config_maps_every_weight_and_computes_our_logits(
        tmp_path, tiny_target_dir, capsys, case):
    draft_args, flags = CASES[case]
    draft = _draft(tiny_target_dir, **draft_args)
    ours = capture_layer_ids_of(draft.config)
    code, out = _export(tmp_path, tiny_target_dir, draft, *flags)
    assert code == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["format"], line["verifier"], line["speculative_tokens"]) == ("speculators", str(tiny_target_dir), 3)
    assert line["capture_layer_ids"] == ours and line["vllm_layer_ids"] == [k + 1 for k in ours]

    config = SpeculatorModelConfig.from_pretrained(out)
    assert type(config) is Eagle3SpeculatorConfig
    layer = config.transformer_layer_config
    assert isinstance(layer, LlamaConfig) and layer.num_hidden_layers == 1
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "hidden_act"):
        assert getattr(layer, field) == getattr(draft.config, field), field
    assert layer.rope_parameters["rope_theta"] == draft.config.rope_parameters["rope_theta"]
    assert (config.draft_vocab_size, config.target_hidden_size) == (VD, draft.target_hidden_size)
    assert (config.norm_before_residual, config.norm_before_fc, config.fc_norm, config.norm_output) == (
        False, False, draft_args.get("fc_norm", False), draft_args.get("norm_output", False))
    assert config.eagle_aux_hidden_state_layer_ids == [k + 1 for k in ours]
    spec = config.speculators_config
    assert (spec.algorithm, spec.default_proposal_method, spec.proposal_methods[0].speculative_tokens) == (
        "eagle3", "greedy", 3)
    assert (spec.verifier.name_or_path, spec.verifier.architectures) == (str(tiny_target_dir), ["LlamaForCausalLM"])

    model = SpeculatorModel.from_pretrained(out)
    assert type(model) is SpeculatorsEagle3
    assert model.config.eagle_aux_hidden_state_layer_ids == [k + 1 for k in ours]  # kept after resolving
    loaded = model.state_dict()
    dtype = torch.bfloat16 if flags else torch.float32
    written = {k: t.to(dtype) if t.is_floating_point() else t for k, t in draft.draft_state_dict().items()}
    assert set(_tensors(out / "model.safetensors")) == {speculators_key(k) for k in written} | {"embed_tokens.weight"}
    assert [k for k, t in written.items() if not torch.equal(loaded[speculators_key(k)], t)] == []
    target = _tensors(tiny_target_dir / "model.safetensors")
    assert torch.equal(loaded["embed_tokens.weight"], target["model.embed_tokens.weight"].to(dtype))
    assert torch.equal(loaded["verifier_lm_head.weight"], target["lm_head.weight"][draft.t2d].to(dtype))

    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 7, 3 * draft.target_hidden_size, generator=g)
    ids = torch.randint(0, draft.config.vocab_size, (1, 7), generator=g)
    positions = torch.arange(7)[None]
    served = Eagle3DraftModel(draft.config)  # our draft from the exported (possibly bf16-rounded) weights, in fp32
    served.load_state_dict({k: t.float() if t.is_floating_point() else t for k, t in written.items()}, strict=False)
    served.load_embedding(target["model.embed_tokens.weight"].to(dtype).float())
    theirs = _ttt_logits_speculators(model.float(), aux, ids, positions, steps=3)
    ours = _ttt_logits_ours(served.eval(), aux, ids, positions, steps=3)
    torch.testing.assert_close(theirs[0], _step0_logits_ours(served, aux, ids, positions), rtol=1e-4, atol=1e-4)
    for k in range(3):  # later steps carry the hidden: norm_output shows there
        torch.testing.assert_close(theirs[k], ours[k], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("norm_output", [False, True], ids=["fc_norm", "eagle31"])
def test_speculators_and_our_draft_agree_step_by_step_on_smollm2_hidden_states(tmp_path, smollm2_dir, capsys,
                                                                                  norm_output):
    """The same EAGLE-3.1 weights in speculators 0.9.0's model and ours, fed hidden states captured
    from SmolLM2-135M-Instruct in fp32: every TTT step's logits agree within 1e-5 relative.

    The training losses differ by design (the next test pins how), so here the forward is compared.
    Both drafts run in float64: in fp32 each implementation is 2e-5 off its own float64 result by
    the fourth step with norm_output (the carried hidden is renormed every step, so the per-step
    update is large relative to it), which would hide a real difference; in float64 they agree to
    a few 1e-6, the floor set by the fp32 RMSNorm, RoPE and softmax that both run inside."""
    draft = _draft(smollm2_dir, fc_norm=True, norm_output=norm_output, seed=3, vd=2048)
    code, out = _export(tmp_path, smollm2_dir, draft)
    assert code == 0
    capsys.readouterr()
    model = SpeculatorModel.from_pretrained(out).double().eval()
    _, ids, target_out, _ = _smollm2_forward(smollm2_dir)
    states = target_out.hidden_states
    aux = torch.cat([states[k + 1] for k in capture_layer_ids_of(draft.config)], dim=-1).double()  # layer k's output
    positions = torch.arange(ids.shape[1])[None]
    theirs = _ttt_logits_speculators(model, aux, ids, positions, steps=4)
    ours = _ttt_logits_ours(draft.double().eval(), aux, ids, positions, steps=4)
    worst = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(theirs, ours)]
    assert max(worst) < 1e-5, worst


@pytest.mark.slow
def test_our_per_position_loss_is_speculators_kl_plus_the_targets_entropy_on_smollm2(tmp_path, smollm2_dir, capsys):
    """The training objective beside speculators 0.9.0's, on the same EAGLE-3.1 weights and the
    same SmolLM2-135M-Instruct batch (float64, as above), every TTT step and position.

    The two differ by design, and this pins how. Ours is SpecForge's: the soft cross-entropy to
    the target's distribution over the draft vocabulary, on the positions whose target argmax is
    in the draft vocabulary (zero elsewhere). speculators' is the KL divergence to the same
    distribution, on every position. On our positions they differ by the target's entropy, a
    constant of the batch, so their gradients to the draft are the same. Accuracy: ours counts a
    position whose target argmax is outside the draft vocabulary as a miss."""
    from speculators.losses.eager import kl_div_loss
    from speculators.models.eagle3.metrics import align_for_step

    from specforge_core.drafts.eagle3 import ttt_unroll

    steps_k = 4
    target, ids, out, pre_norm = _smollm2_forward(smollm2_dir)
    draft = _draft(smollm2_dir, fc_norm=True, norm_output=True, seed=3, vd=2048)
    # a draft vocabulary holding the target's next tokens here but one, so that most positions
    # carry a loss and some show the mask
    vocab, nexts = draft.config.vocab_size, out.logits[0].argmax(-1)
    left_out = nexts[-3:-2]  # a late position's: every step has a row that reads it
    nexts = nexts[nexts != left_out].unique()
    others = torch.randperm(vocab, generator=torch.Generator().manual_seed(4))
    others = others[~torch.isin(others, torch.cat([nexts, left_out]))][: 2048 - nexts.numel()]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[nexts], t2d[others] = True, True
    draft.set_vocab_map(torch.nonzero(t2d).flatten() - torch.arange(2048), t2d)
    code, exported = _export(tmp_path, smollm2_dir, draft)
    assert code == 0
    capsys.readouterr()
    f64 = torch.float64
    aux = torch.cat([out.hidden_states[k + 1] for k in capture_layer_ids_of(draft.config)], dim=-1).to(f64)
    t = ids.shape[1]

    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids), aux_hidden=aux,
                 last_hidden=out.hidden_states[-1].to(f64))  # the normed last hidden: the head reads it
    with torch.no_grad():
        ours = ttt_unroll(draft.to(f64).eval(), batch, target.lm_head.weight.to(f64), ttt_length=steps_k,
                          backend="sdpa", compile=False)

    # speculators' row t is our row t: the token after t, the target's hidden at t, the target at t + 1
    model = SpeculatorModel.from_pretrained(exported).to(f64).eval()
    _eager_attention(model)
    ids_s, aux_s, last_s = ids[:, 1:], aux[:, :-1], pre_norm[:, 1:].to(f64)  # it applies the final norm
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux_s, input_ids=ids_s, document_ids=torch.zeros_like(ids_s),
              position_ids=torch.arange(t - 1)[None], verifier_last_hidden_states=last_s,
              loss_mask=torch.ones_like(ids_s, dtype=torch.bool), ttt_steps=steps_k,
              loss_config={"kl_div": (kl_div_loss, 1.0)})
        targets = model.verifier_lm_head(model.verifier_norm(last_s))
    hook.remove()

    for k in range(steps_k):
        step_logits, step_targets, _, _ = align_for_step(logits[k], targets, None, None, k)
        n = step_logits.shape[1]  # speculators' rows of step k: those with a target
        kl = kl_div_loss(step_logits, step_targets)[0]
        p = torch.softmax(step_targets[0], dim=-1)
        entropy = -(p * p.log()).sum(-1)
        in_draft = ours[k].in_draft[0, :n] > 0
        assert ours[k].valid[0, :n].all() and not ours[k].valid[0, n:].any()  # the same rows
        assert 0 < in_draft.sum() < n  # positions of both kinds at every step
        loss = ours[k].loss[0, :n]
        worst = ((loss - in_draft * (kl + entropy)).abs().max() / (kl + entropy).max()).item()
        assert worst < 1e-5, (k, worst)
        hits = step_logits[0].argmax(-1) == step_targets[0].argmax(-1)  # speculators' full_acc numerator
        assert torch.equal(ours[k].correct[0, :n] > 0, hits & in_draft)


def test_a_config_claiming_norm_before_residual_would_compute_other_logits(tmp_path, tiny_target_dir, capsys):
    """Why the field is written: vLLM assumes true without it, and the layer then differs."""
    draft = _draft(tiny_target_dir)
    _, out = _export(tmp_path, tiny_target_dir, draft)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"norm_before_residual": True}))
    g = torch.Generator().manual_seed(1)
    aux, ids = torch.randn(1, 5, 3 * draft.target_hidden_size, generator=g), torch.randint(0, 512, (1, 5), generator=g)
    theirs = _step0_logits_speculators(SpeculatorModel.from_pretrained(out), aux, ids, torch.arange(5)[None])
    assert (theirs - _step0_logits_ours(draft.eval(), aux, ids, torch.arange(5)[None])).abs().max() > 0.1


def test_the_sglang_export_is_still_the_default_and_takes_no_speculators_flags(tmp_path, tiny_target_dir, capsys):
    draft = _draft(tiny_target_dir)
    save_draft_checkpoint_files(draft, tmp_path / "step")
    assert main(["--checkpoint", str(tmp_path / "step"), "--out", str(tmp_path / "a")]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "sglang"
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert main(["--checkpoint", str(tmp_path / "step"), "--out", str(tmp_path / "b"),
                 "--target", str(tiny_target_dir)]) == 2
    assert "error: --target: --target only apply to --format speculators" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "step"), "--out", str(tmp_path / "c"), "--format", "speculators"]) == 2
    err = capsys.readouterr().err
    assert "error: --target:" in err and "fix: give --target the local directory" in err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()

