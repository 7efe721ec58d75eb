"""A slow reference of the DFlash objective, written straight from dflash-facts §2.4 and §3.

Loops over samples, anchors, layers, slots, heads and keys; float64 throughout; no code shared
with ``specforge_core.drafts.dflash``. It never sees rows or packing: each sample is its own
sequence, positions start at 0, and the context of a block is that sample's tokens before the
anchor. ``reference_mask`` builds the fast path's row-layout mask by loops for the mask tests.
"""

import math

import torch


def rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean() + eps)


def rotate(x, position, theta):
    d = x.shape[0]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.cat([position * inv, position * inv])
    rotated_half = torch.cat([-x[d // 2 :], x[: d // 2]])
    return x * torch.cos(angles) + rotated_half * torch.sin(angles)


def reference_anchors(samples, num_anchors, generator):
    """Per sample in order: draw L uniform keys; the ``num_anchors`` candidates p (lm[p] and
    lm[p+1]) with the smallest keys (ties: smaller p), sorted."""
    out = []
    for s in samples:
        ids, lm = s["ids"].tolist(), s["lm"].tolist()
        keys = torch.rand(len(ids), generator=generator).tolist()
        cands = [p for p in range(len(ids) - 1) if lm[p] and lm[p + 1]]
        out.append(sorted(sorted(cands, key=lambda p: (keys[p], p))[:num_anchors]))
    return out


def reference_dflash(p, config, samples, embed, head, *, num_anchors, gamma, generator):
    """Numerator Σ w·CE, Σ w and the metric sums of the DFlash objective.

    ``p``: float64 parameters keyed like the draft's state dict. Returns dict(loss_sum,
    weight_sum, correct[B-1], total[B-1], ce_sum[B-1], accept_reach[B], anchors, logits
    {(sample, anchor): list of [V] per slot}).
    """
    eps, theta = config.rms_norm_eps, config.rope_parameters["rope_theta"]
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    B = config.block_size
    mask_id = config.dflash_config["mask_token_id"]
    window = config.sliding_window
    embed, head = embed.double(), head.double()
    zero = torch.zeros((), dtype=torch.float64)
    out = {"loss_sum": zero, "weight_sum": zero, "correct": [zero] * (B - 1), "total": [zero] * (B - 1),
           "ce_sum": [zero] * (B - 1), "accept_reach": [zero] * B, "logits": {}}
    out["anchors"] = reference_anchors(samples, num_anchors, generator)
    for s, (sample, anchors) in enumerate(zip(samples, out["anchors"])):
        ids, lm, aux = sample["ids"].tolist(), sample["lm"].tolist(), sample["aux"].double()
        L = len(ids)
        ctx = [rms(p["fc.weight"] @ aux[t], p["hidden_norm.weight"], eps) for t in range(L)]
        for a in anchors:
            z = [embed[ids[a]]] + [embed[mask_id]] * (B - 1)
            for layer, layer_type in enumerate(config.layer_types):
                w = {n[len(f"layers.{layer}.") :]: v for n, v in p.items() if n.startswith(f"layers.{layer}.")}

                def heads(x, n):
                    return [x[i * hd : (i + 1) * hd] for i in range(n)]

                def key(x, pos):
                    return [rotate(rms(k, w["self_attn.k_norm.weight"], eps), pos, theta)
                            for k in heads(w["self_attn.k_proj.weight"] @ x, nkv)]

                u = [rms(z[o], w["input_layernorm.weight"], eps) for o in range(B)]
                ctx_k = {t: key(ctx[t], t) for t in range(a)}
                ctx_v = {t: heads(w["self_attn.v_proj.weight"] @ ctx[t], nkv) for t in range(a)}
                blk_k = [key(u[o], a + o) for o in range(B)]
                blk_v = [heads(w["self_attn.v_proj.weight"] @ u[o], nkv) for o in range(B)]
                new_z = []
                for o in range(B):
                    qs = [rotate(rms(q, w["self_attn.q_norm.weight"], eps), a + o, theta)
                          for q in heads(w["self_attn.q_proj.weight"] @ u[o], nh)]
                    sliding = layer_type == "sliding_attention"
                    ctx_seen = [t for t in range(a) if not sliding or t >= a + o - (window - 1)]
                    blk_seen = [o2 for o2 in range(B) if not sliding or o2 <= o]
                    outs = []
                    for i in range(nh):
                        g = i // (nh // nkv)
                        cand = [(ctx_k[t][g], ctx_v[t][g]) for t in ctx_seen]
                        cand += [(blk_k[o2][g], blk_v[o2][g]) for o2 in blk_seen]
                        scores = torch.stack([qs[i] @ k for k, _ in cand]) / math.sqrt(hd)
                        probs = torch.softmax(scores, dim=0)
                        outs.append(sum(probs[c] * cand[c][1] for c in range(len(cand))))
                    r = z[o] + w["self_attn.o_proj.weight"] @ torch.cat(outs)
                    m = rms(r, w["post_attention_layernorm.weight"], eps)
                    mlp = w["mlp.down_proj.weight"] @ (torch.nn.functional.silu(w["mlp.gate_proj.weight"] @ m)
                                                        * (w["mlp.up_proj.weight"] @ m))
                    new_z.append(r + mlp)
                z = new_z
            logits = [head @ rms(z[o], p["norm.weight"], eps) for o in range(B)]
            out["logits"][(s, a)] = logits
            leading = True
            out["accept_reach"][0] = out["accept_reach"][0] + 1
            for k in range(1, B):
                target = a + k < L and lm[a + k] == 1
                hit = target and int(torch.argmax(logits[k])) == ids[a + k]
                leading = leading and hit
                if leading:
                    out["accept_reach"][k] = out["accept_reach"][k] + 1
                if not target:
                    continue
                weight = math.exp(-(k - 1) / gamma) if gamma is not None else 1.0
                ce = -torch.log_softmax(logits[k], dim=0)[ids[a + k]]
                out["loss_sum"] = out["loss_sum"] + weight * ce
                out["weight_sum"] = out["weight_sum"] + weight
                out["correct"][k - 1] = out["correct"][k - 1] + float(hit)
                out["total"][k - 1] = out["total"][k - 1] + 1
                out["ce_sum"][k - 1] = out["ce_sum"][k - 1] + ce.detach()
    for name in ("correct", "total", "ce_sum", "accept_reach"):
        out[name] = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out[name]])
    return out


def reference_mask(batch, anchor_col, keep, block_size, window):
    """The row-layout mask ``[b, NB·B, T+NB·B]`` by loops, from the batch's rows alone.

    A sample is a run of real tokens with one seq id (one run per row when unpacked). Block
    slot j of row r (anchor column ``anchor_col[r][j]``, kept or padding) at offset o sees
    context column c iff kept, c is in the anchor's run, c < anchor and (sliding) c ≥ anchor + o
    − (W−1); and block key (j', o') iff j' == j and (sliding) o' ≤ o.
    """
    attn = batch["attention_mask"].tolist()
    seq = batch["seq_ids"].tolist() if batch.get("seq_ids") is not None else None
    rows, nb = len(anchor_col), len(anchor_col[0])
    t = len(attn[0])
    mask = torch.zeros(rows, nb * block_size, t + nb * block_size, dtype=torch.bool)
    for r in range(rows):
        run = [None] * t  # a label per real token: same label = same sample
        for c in range(t):
            if attn[r][c]:
                run[c] = seq[r][c] if seq is not None else 0
        for j in range(nb):
            a = anchor_col[r][j]
            for o in range(block_size):
                q = j * block_size + o
                for o2 in range(block_size):
                    if window is None or o2 <= o:
                        mask[r, q, t + j * block_size + o2] = True
                if not keep[r][j]:
                    continue
                for c in range(t):
                    same = run[c] is not None and run[c] == run[a] and all(run[x] == run[a] for x in range(c, a + 1))
                    if same and c < a and (window is None or c >= a + o - (window - 1)):
                        mask[r, q, c] = True
    return mask
