"""A slow reference of the EAGLE3 objective, written straight from the math (one-token shift, TTT mask,
0.8^k weights, soft targets over the draft vocabulary, metrics), with EAGLE-3.1's options: per-layer
norms before ``fc`` (``fc_norm.{i}.weight`` present) and, with ``config.norm_output``, the post-norm
hidden ``norm(h')`` carried to the next step (the logits stay ``lm_head(norm(h'))``).

Explicit loops over rows, steps, positions, heads and keys; float64 throughout; no code shared
with ``specforge_core.drafts.eagle3`` (only the RoPE inverse frequencies come from transformers, the
same source serving uses). Rows are right-padded; ``lm[L-1]`` of every row is zeroed (the last
real token has no next-token target), as SpecForge's offline normalisation does.
"""

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean() + eps)


def rope_tables(config):
    """(inv_freq, attention scaling) in float64 for the config's RoPE type."""
    rope = config.rope_parameters
    if rope["rope_type"] == "default":
        d = config.head_dim
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        return inv, 1.0
    inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    return inv.double(), float(scale)


def rotate(x, position, inv, scale):
    angles = torch.cat([position * inv, position * inv])
    half = x.shape[0] // 2
    rotated_half = torch.cat([-x[half:], x[:half]])
    return x * torch.cos(angles) * scale + rotated_half * torch.sin(angles) * scale


def reference_eagle3(p, config, batch, W, t2d, d2t, K, decay=0.8):
    """Loss, per-step metric sums and per-step logits of the EAGLE3 objective.

    ``p``: float64 parameter dict keyed like the draft's state dict (plus ``embed_tokens.weight``).
    Returns dict(loss, loss_sum[K], acc_correct[K], acc_total[K], accept_sum[K], accept_total[K],
    logits: list over k of [B][T] tensors).
    """
    eps = config.rms_norm_eps
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    Ht = config.target_hidden_size
    inv, rscale = rope_tables(config)
    ids_all, attn_all = batch["input_ids"], batch["attention_mask"]
    lm_all, aux_all, last_all = batch["loss_mask"], batch["aux_hidden"].double(), batch["last_hidden"].double()
    B, T = ids_all.shape
    W = W.double()
    draft_ids = [i for i in range(t2d.numel()) if t2d[i]]
    Vd = len(draft_ids)
    zero = torch.zeros((), dtype=torch.float64)
    out = {name: [zero.clone() for _ in range(K)] for name in ("loss_sum", "acc_correct", "acc_total", "accept_sum", "accept_total")}
    out["logits"] = [[[None] * T for _ in range(B)] for _ in range(K)]

    for b in range(B):
        L = int(attn_all[b].sum())
        # One-token shift of ids and teacher (zero fill / padding values), mask unshifted with lm[L-1] = 0.
        ids_s = [int(ids_all[b, t + 1]) if t + 1 < T else 0 for t in range(T)]
        lm = [float(lm_all[b, t]) if t < L - 1 else 0.0 for t in range(T)]
        P, Pon, tok = [], [], []
        for t in range(T + K):
            if t < T - 1:
                z = W @ last_all[b, t + 1]
                P.append(torch.softmax(z[draft_ids], dim=0))
                Pon.append(torch.softmax(z, dim=0)[draft_ids])
                tok.append(int(torch.argmax(z)))
            else:
                P.append(torch.full((Vd,), 1.0 / Vd, dtype=torch.float64))
                Pon.append(torch.zeros(Vd, dtype=torch.float64))
                tok.append(0)
        pm = [float(t2d[tok[t]]) * lm[t] if t < T else 0.0 for t in range(T + K)]
        lm += [0.0] * K

        h = []
        for t in range(T):
            x = aux_all[b, t]
            if "fc_norm.0.weight" in p:
                x = torch.cat([rms(x[i * Ht : (i + 1) * Ht], p[f"fc_norm.{i}.weight"], eps) for i in range(3)])
            h.append(p["fc.weight"] @ x)
        keys, values = [], []  # keys[j][t][kv head]
        for k in range(K):
            ids_k = [ids_s[t + k] if t + k < T else 0 for t in range(T)]
            qs, ks, vs = [], [], []
            for t in range(T):
                e = p["embed_tokens.weight"][ids_k[t]]
                x = torch.cat([rms(e, p["midlayer.input_layernorm.weight"], eps), rms(h[t], p["midlayer.hidden_norm.weight"], eps)])
                q = (p["midlayer.self_attn.q_proj.weight"] @ x).view(nh, hd)
                kk = (p["midlayer.self_attn.k_proj.weight"] @ x).view(nkv, hd)
                vv = (p["midlayer.self_attn.v_proj.weight"] @ x).view(nkv, hd)
                qs.append([rotate(q[i], t + k, inv, rscale) for i in range(nh)])
                ks.append([rotate(kk[i], t + k, inv, rscale) for i in range(nkv)])
                vs.append([vv[i] for i in range(nkv)])
            keys.append(ks)
            values.append(vs)
            new_h = []
            for t in range(T):
                heads = []
                for i in range(nh):
                    g = i // (nh // nkv)
                    # step-0 keys: causal, real tokens (or itself); then same-position keys of steps 1..k
                    cand = [(keys[0][s][g], values[0][s][g]) for s in range(t + 1) if s < L or s == t]
                    cand += [(keys[j][t][g], values[j][t][g]) for j in range(1, k + 1)]
                    scores = torch.stack([qs[t][i] @ key for key, _ in cand]) / hd**0.5
                    w = torch.softmax(scores, dim=0)
                    heads.append(sum(w[c] * cand[c][1] for c in range(len(cand))))
                a = p["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
                r = h[t] + a
                m = rms(r, p["midlayer.post_attention_layernorm.weight"], eps)
                gate = p["midlayer.mlp.gate_proj.weight"] @ m
                up = p["midlayer.mlp.up_proj.weight"] @ m
                new_h.append(r + p["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up))
            normed = [rms(x, p["norm.weight"], eps) for x in new_h]
            h = normed if getattr(config, "norm_output", False) else new_h
            for t in range(T):
                z = p["lm_head.weight"] @ normed[t]
                out["logits"][k][b][t] = z
                lm_k, pm_k = lm[t + k], pm[t + k]
                logq = torch.log_softmax(z, dim=0)
                out["loss_sum"][k] = out["loss_sum"][k] - pm_k * (P[t + k] * logq).sum()
                hit = float(int(torch.argmax(z)) + int(d2t[int(torch.argmax(z))]) == tok[t + k])
                out["acc_correct"][k] = out["acc_correct"][k] + lm_k * hit
                out["acc_total"][k] = out["acc_total"][k] + lm_k
                out["accept_sum"][k] = out["accept_sum"][k] + pm_k * torch.minimum(Pon[t + k], torch.softmax(z, dim=0)).sum()
                out["accept_total"][k] = out["accept_total"][k] + pm_k
    out["loss"] = sum(decay**k * out["loss_sum"][k] for k in range(K)) / (B * T)
    for name in ("loss_sum", "acc_correct", "acc_total", "accept_sum", "accept_total"):
        out[name] = torch.stack([v if torch.is_tensor(v) else torch.tensor(v) for v in out[name]])
    return out
