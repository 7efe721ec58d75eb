"""Our export, served by the real SGLang: its acceptance length beside our evaluator's, same prompts.

    python bench/gpu_sglang_serve.py --target TARGET_DIR --draft EXPORT_DIR --prompts prompts.jsonl \
        --max-new-tokens 64 [--num-steps 3] --out DIR        # on a GPU node with sglang==0.5.14

``--prompts``: JSONL of ``{"prompt_ids": [...]}`` (token ids ending with the generation prompt;
``--write-prompts`` makes it from a run config's held-out split on a CPU machine). Both sides
decode greedily with chain drafting (topk 1, ``num_steps`` draft tokens per verify pass,
``ignore_eos``):

- ours: ``decoding.measure.measure_acceptance`` with the target in transformers (bf16 on the GPU);
- SGLang, by the export's family: an EAGLE3 draft (EAGLE-3.1's ``fc_norm`` and ``norm_output``
  included: 0.5.14's ``llama_eagle3.py`` reads both) as ``sglang.Engine(model_path=TARGET,
  speculative_algorithm="EAGLE3", speculative_draft_model_path=EXPORT, speculative_num_steps=k,
  speculative_eagle_topk=1, speculative_num_draft_tokens=k+1)``; a DFlash draft as
  ``speculative_algorithm="DFLASH", speculative_num_draft_tokens=block_size`` (its verify window;
  ``--num-steps`` defaults to ``block_size − 1`` then, our decoding's natural setting). DFlash2 and
  DSpark drafts are refused: 0.5.14 has neither (its ``models/dflash.py`` has no convolution or
  selector, and there is no DSPARK algorithm). Its ``meta_info["spec_verify_ct"]`` summed over
  the prompts is its verify passes, and τ = (completion tokens − prompts) / verify passes, our count.

Prints both τ and their ratio (the check passes within 5 %) as ``RESULT {json}`` and writes
``DIR/sglang_serve.json``. In bf16 SGLang's speculative output can differ from its own plain
output at near-tied argmaxes, so compare τ here and check losslessness in fp32 on our side.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_prompts(config: str, out: str, n: int) -> None:
    from specforge_core.config import load_config
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.decoding.evaluation import held_out_prompts

    cfg = load_config(config)
    prompts = held_out_prompts(cfg, load_tokenizer(cfg), n)
    Path(out).write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts → {out}")


def ours(target: str, draft: str, prompts: list[list[int]], k: int, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from specforge_core.decoding.measure import measure_acceptance
    from specforge_core.drafts import load_draft

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).to("cuda").eval()
    family, draft_model = load_draft(draft)
    draft_model = family.prepare_for_decoding(draft_model, model)
    layers = family.trained_layer_ids(draft_model.config)
    t0 = time.perf_counter()
    out = measure_acceptance(model, family.drafter(draft_model, model), prompts, stop_ids=set(),
                             capture_layer_ids=layers, num_steps=k, max_new_tokens=new_tokens, batch_size=8)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def sglang_side(target: str, draft: str, prompts: list[list[int]], spec: dict, new_tokens: int) -> dict:
    import sglang

    engine = sglang.Engine(model_path=target, speculative_draft_model_path=draft, **spec,
                           attention_backend="triton", skip_tokenizer_init=True, disable_cuda_graph=True,
                           sampling_backend="pytorch", dtype="bfloat16", mem_fraction_static=0.5)
    try:
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens,
                                                                   "ignore_eos": True})
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"verify_passes": verify, "generated_tokens": tokens,
            "acceptance_length": (tokens - len(prompts)) / verify if verify else None, "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-prompts", nargs=2, metavar=("CONFIG", "OUT"), help="CPU side: held-out prompts → JSONL")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--num-steps", type=int, default=None,
                    help="draft tokens per verify pass (default: 3 for EAGLE3, block_size - 1 for DFlash)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="/tmp/sglang-serve")
    args = ap.parse_args(argv)
    if args.write_prompts:
        write_prompts(*args.write_prompts, args.limit)
        return 0
    prompts = [json.loads(x)["prompt_ids"] for x in Path(args.prompts).read_text().splitlines()][: args.limit]
    from specforge_core.decoding.served import speculative_arguments

    spec, k = speculative_arguments(args.draft, args.num_steps)
    mine = ours(args.target, args.draft, prompts, k, args.max_new_tokens)
    theirs = sglang_side(args.target, args.draft, prompts, spec, args.max_new_tokens)
    ratio = theirs["acceptance_length"] / mine["acceptance_length"]
    result = {"prompts": len(prompts), "sglang_args": spec, "num_steps": k, "max_new_tokens": args.max_new_tokens,
              "ours": {k: mine[k] for k in ("acceptance_length", "verify_passes", "generated_tokens", "wall_s")},
              "sglang": theirs, "sglang_over_ours": round(ratio, 4), "ok": abs(ratio - 1) <= 0.05}
    print("RESULT " + json.dumps(result), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sglang_serve.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
