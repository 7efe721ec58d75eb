"""A slow float64 reference of the DSpark objective, written from speculators 0.9.0's DSpark
definition (``models/dspark``) with plain loops over samples, anchors and slots.

The backbone's per-slot output comes from the DFlash loop reference (``tests.drafts.dflash.
reference``) run with an identity "head", so nothing here shares code with
``specforge_core.drafts.dspark``. Each sample is its own sequence; ``last`` is its post-norm
final hidden (the teacher: ``softmax(W last[t])`` is the target's distribution of token t+1).
"""

import math

import torch

from tests.drafts.dflash.reference import reference_dflash


def _markov_features(p, head_type, e, h, state):
    if head_type == "vanilla":
        return e, state
    if head_type == "gated":
        gate = torch.sigmoid(p["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + p["markov_head.gate_proj.bias"])
        return gate * e, state
    joint = p["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + p["markov_head.joint_proj.bias"]
    r = e.shape[0]
    z, c, o = joint[:r], joint[r : 2 * r], joint[2 * r :]
    state = torch.sigmoid(z) * state + (1 - torch.sigmoid(z)) * torch.tanh(c)
    return torch.tanh(o), state


def _term(name, q_logits, p_logits):
    logq, logp = torch.log_softmax(q_logits, 0), torch.log_softmax(p_logits, 0)
    if name == "kl_div":
        return (logp.exp() * (logp - logq)).sum()
    if name == "tv":
        return 1 - torch.minimum(logq.exp(), logp.exp()).sum()
    return -logq[int(torch.argmax(p_logits))]


def reference_dspark(draft, samples, embed, head, *, num_anchors, generator, loss_terms, gamma,
                     confidence_head_alpha, dpace_alpha=None):
    """Numerator, Σ m and the metric sums, keyed as ``dspark_loss``'s sums. ``dpace_alpha``
    set: D-PACE slot weights for the loss terms (fixed decay for the confidence BCE)."""
    p = {k: v.detach().double() for k, v in draft.state_dict().items()}
    config, B = draft.config, draft.block_size
    fields = config.dspark_config
    s0 = 0 if fields["sample_from_anchor"] else 1
    H = config.hidden_size
    eye = torch.eye(H, dtype=torch.float64)
    state0 = reference_dflash({k: v for k, v in p.items() if not k.startswith(("markov", "confidence"))}, config,
                              samples, embed, eye, num_anchors=num_anchors, gamma=None, generator=generator)
    embed, head = embed.double(), head.double()
    n = B - s0
    out = {k: 0.0 for k in ("loss_sum", "weight_sum", "confidence_sum", "accept_rate_sum", "accept_len_sum",
                            "greedy_len_sum", "blocks", "confidence_abs_error_sum", "confidence_pred_sum",
                            "confidence_cumprod_bias_sum")}
    out["correct"], out["total"] = [0.0] * n, [0.0] * n
    for s, (sample, anchors) in enumerate(zip(samples, state0["anchors"])):
        ids, lm, last = sample["ids"].tolist(), sample["lm"].tolist(), sample["last"].double()
        L = len(ids)
        for a in anchors:
            hidden = state0["logits"][(s, a)]  # identity head: the normed backbone outputs
            state = torch.zeros(fields["markov_rank"], dtype=torch.float64)
            rows = []
            for k in range(B):
                h = hidden[k]
                prev = ids[min(a + k - s0, L - 1)] if k >= s0 else ids[a]
                logits = head @ h
                e = p["markov_head.markov_w1.weight"][prev] if fields["markov_rank"] else None
                if e is not None:
                    f, state = _markov_features(p, fields["markov_head_type"], e, h, state)
                    logits = logits + p["markov_head.markov_w2.weight"] @ f
                conf = None
                if fields["enable_confidence_head"]:
                    x = torch.cat([h, e]) if fields["confidence_head_with_markov"] else h
                    conf = float(p["confidence_head.proj.weight"][0] @ x + p["confidence_head.proj.bias"][0])
                m = k >= s0 and a + k < L and lm[a + k] == 1
                if not m:
                    rows.append(dict(m=0.0, ell={t: 0.0 for t in loss_terms}, rate=0.0, hit=False, conf=conf))
                    continue
                teacher = head @ last[a + k - s0]
                rate = float(torch.minimum(torch.softmax(logits, 0), torch.softmax(teacher, 0)).sum())
                rows.append(dict(m=1.0, ell={t: float(_term(t, logits, teacher)) for t in loss_terms}, rate=rate,
                                 hit=int(torch.argmax(logits)) == int(torch.argmax(teacher)), conf=conf))
            for name, c in loss_terms.items():
                for k, row in enumerate(rows):
                    if dpace_alpha is None:
                        w = math.exp(-(k - s0) / gamma) if k >= s0 else 0.0
                    else:
                        w = 0.0
                        if row["m"]:
                            for j in range(k, B):
                                prod = 1.0
                                for i in range(j + 1):
                                    if rows[i]["m"]:
                                        prod *= (1 - dpace_alpha) * math.exp(-rows[i]["ell"][name]) + dpace_alpha
                                w += prod * rows[j]["m"]
                    out["loss_sum"] += c * w * row["m"] * row["ell"][name]
            prefix_rate, prefix_hit, prefix_conf, block_has = 1.0, 1.0, 1.0, False
            for k in range(s0, B):
                row = rows[k]
                out["weight_sum"] += row["m"]
                prefix_rate *= row["rate"] * row["m"]
                prefix_hit *= float(row["hit"] and row["m"] > 0)
                out["accept_len_sum"] += prefix_rate
                out["greedy_len_sum"] += prefix_hit
                out["accept_rate_sum"] += row["rate"] * row["m"]
                out["correct"][k - s0] += float(row["hit"] and row["m"] > 0)
                out["total"][k - s0] += row["m"]
                block_has = block_has or row["m"] > 0
                if row["conf"] is not None:
                    prob = 1 / (1 + math.exp(-row["conf"]))
                    bce = -(row["rate"] * math.log(prob) + (1 - row["rate"]) * math.log(1 - prob))
                    out["confidence_sum"] += math.exp(-(k - s0) / gamma) * row["m"] * bce
                    out["confidence_abs_error_sum"] += abs(prob - row["rate"]) * row["m"]
                    out["confidence_pred_sum"] += prob * row["m"]
                    prefix_conf *= prob * row["m"]
                    out["confidence_cumprod_bias_sum"] += (prefix_conf - prefix_rate) * row["m"]
            if block_has:
                out["blocks"] += 1
                out["accept_len_sum"] += 1.0
                out["greedy_len_sum"] += 1.0
    out["loss_sum"] += confidence_head_alpha * out["confidence_sum"]
    if not fields["enable_confidence_head"]:
        for key in ("confidence_abs_error_sum", "confidence_pred_sum", "confidence_cumprod_bias_sum"):
            del out[key]
    return out
