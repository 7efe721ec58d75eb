"""Does a draft chain its steps? Teacher-forced conditional accuracy and an input-token ablation.

    PYTHONPATH=. python scripts/chain_probe.py --config examples/smollm2-realcheck.yaml \
        --draft runs/smollm2-realcheck/checkpoints/step-00000064 [--rows 8] [--ttt 3]

Runs the training unroll (``drafts.eagle3.objective.ttt_unroll``, the code the trainer runs) with the draft
on the first ``--rows`` rows of the prompt cache's train split, captured by the ``hf`` backend,
and prints per step k: acc_k (unconditional, as training logs it), the chain accuracy
P(step k right | steps 0..k-1 right) — which is what speculative decoding's per-position
acceptance measures when the rows are the target's own greedy answers — and the same figures
with every input token replaced by a random one. If the figures barely move without the real
tokens, the draft predicts from the captured states alone: every step re-predicts the same token
and P(d2 | d1) ≈ 0 at decode (docs/validation-smollm2.md, "Why P(d2 | d1) ≈ 0").
"""

import argparse

import torch

from specforge_core.capture.base import TargetRequest
from specforge_core.capture.hf import HFCaptureBackend
from specforge_core.config import load_config
from specforge_core.data.prompt_cache import ensure_prompt_cache
from specforge_core.decoding.verifier import load_target
from specforge_core.decoding.evaluation import capture_layers_for, load_draft_for_decoding
from specforge_core.drafts import check_config
from specforge_core.drafts.eagle3.objective import ttt_unroll


def chain_figures(draft, batch: dict, lm_head_weight: torch.Tensor, ttt_length: int) -> list[tuple]:
    """Per step k: (acc_k, right_k, total_k, chain_right_k, chain_total_k), teacher-forced.

    chain_*: positions where steps 0..k-1 were right (and step k has a target) and step k too."""
    steps = ttt_unroll(draft, batch, lm_head_weight, ttt_length=ttt_length, backend="sdpa")
    out, chain = [], None
    for s in steps:
        right, valid = s.correct.bool(), s.valid.bool()
        reached = valid if chain is None else valid & chain
        out.append((right[valid].float().mean().item(), int(right[valid].sum()), int(valid.sum()),
                    int((right & reached).sum()), int(reached.sum())))
        chain = right & reached
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--draft", required=True, help="checkpoint step, run or exported directory")
    ap.add_argument("--rows", type=int, default=8, help="training rows to probe (from the start of the split)")
    ap.add_argument("--ttt", type=int, default=3, help="unrolled steps to report")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    cfg = check_config(load_config(args.config, args.overrides))
    model, tok = load_target(cfg)
    family, draft = load_draft_for_decoding(args.draft, model)
    rows = ensure_prompt_cache(cfg, tok).train.select(range(args.rows))
    request = TargetRequest.from_rows([list(map(int, r)) for r in rows["input_ids"]],
                                      [list(map(int, r)) for r in rows["loss_mask"]], slice(0, args.rows))
    backend = HFCaptureBackend(model, tuple(capture_layers_for(cfg, model, family, draft)))
    cap = backend.capture(request)
    fields = ("input_ids", "attention_mask", "loss_mask", "aux_hidden", "last_hidden")
    batch = {name: getattr(cap, name) for name in fields}
    seed = torch.Generator().manual_seed(0)
    random_ids = torch.randint(0, model.config.vocab_size, cap.input_ids.shape, generator=seed)
    for label, b in (("real input tokens", batch), ("random input tokens", dict(batch, input_ids=random_ids))):
        print(label)
        for k, (acc, r, n, cr, cn) in enumerate(chain_figures(draft, b, backend.lm_head_weight, args.ttt)):
            print(f"  step {k}: acc {acc:.3f} ({r}/{n})   P(right | steps <{k} right) {cr}/{cn}"
                  + (f" = {cr / cn:.3f}" if cn else ""))


if __name__ == "__main__":
    main()
