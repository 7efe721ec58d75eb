"""Training answers made by the serving engine: SGLang's regeneration beside transformers' on a sample.

    python bench/gpu_regenerate.py --config examples/smollm2-realcheck.yaml model.target=/tmp/smollm2 \
        --prompts prompts-train.jsonl --answers 20000 --sample 64 --out DIR        # GPU node, sglang==0.5.14

Needs torch, transformers and SGLang (``../shared/gpu/sglang/README.md`` brings 0.5.14 onto the
GPU machine); the prompts are a JSONL of conversations whose first user turn is the prompt (what
``scripts/sharegpt_realcheck.py --stages data`` writes as ``prompts-train-*.jsonl``, made on a
CPU machine and carried). Two runs of ``specforge_core.regenerate``'s own function:

1. ``--engine sglang`` over the first ``--answers`` prompts (``--batch-size`` a call), greedy,
   ``--answer-tokens`` at most: answers/s and tokens/s as the command prints them. Resumable: run
   it again and it answers only what is missing.
2. ``--engine hf`` (transformers on the same GPU, bf16 unless the config says otherwise) over the
   first ``--sample`` of the same prompts, into a file of its own.

Then, per sampled prompt, whether the two greedy answers are the same token for token (decoded
text compared; tokenised again with the run's tokenizer), and for those that differ, at which
answer token they part. Why they part: the target in float32 reads each parted prompt with the
reference's answer, and at the parting token gives its top-2 logit gap, which engine's token it
picks, and the share of that answer's other tokens whose gap is smaller. In bf16 two engines'
kernels round differently, and one near-tied argmax is enough to send the rest of an answer
elsewhere: partings at small gaps, with the float32 pick on either engine's side, are that.
``--reference-dtype float32`` answers the sample in float32 instead (on a CPU too, with the SGLang
answers to all of ``--prompts`` already in ``DIR``, no engine starts); against a float32
reference the pick is the reference's by construction, and the gaps alone speak. Prints ``RESULT {json}`` and
writes ``DIR/regenerate.json`` (the answers stay in ``DIR``).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def in_dtype(cfg, dtype: str):
    """``cfg`` with its target loaded in ``dtype``."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": dtype})})


def rows_by_id(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return {row["id"]: row for row in rows}


def answers(path: Path) -> dict[str, str]:
    return {key: row["conversations"][-1]["content"] for key, row in rows_by_id(path).items()}


def compare_answers(tok, ours: dict[str, str], reference: dict[str, str]) -> dict:
    """Same answers, and where the others part: per parted answer its id, the answer-token index of
    the first difference and the two tokens there (None where one answer ends first)."""
    same, partings = 0, []
    for key, text in reference.items():
        a, b = (tok(t, add_special_tokens=False)["input_ids"] for t in (ours[key], text))
        if a == b:
            same += 1
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        partings.append({"id": key, "at": at, "ours_token": a[at] if at < len(a) else None,
                         "reference_token": b[at] if at < len(b) else None})
    partings.sort(key=lambda p: p["at"])
    return {"compared": len(reference), "same": same, "differ": len(partings),
            "first_difference_at_tokens": [p["at"] for p in partings], "partings": partings}


def parting_margins(cfg, rows: dict[str, dict], partings: list[dict]) -> dict:
    """The float32 target at each parting (``compare_answers``' records, updated in place): its
    top-2 logit gap there, whose token it picks (``ours``, ``reference`` or ``neither``), and the
    share of the reference answer's tokens with a smaller gap; ``rows`` are the reference's rows.
    The target is ``cfg``'s, on ``capture.device``. Its pick tells the engines apart only where
    the reference is not itself float32 greedy (then it picks the reference by construction)."""
    import statistics

    import torch

    from specforge_core.data.tokenize import ChatRenderer
    from specforge_core.decoding.verifier import load_target

    weighable = [p for p in partings if p["ours_token"] is not None and p["reference_token"] is not None]
    if weighable:  # one answer being the other's start leaves no token to weigh
        model, tok = load_target(in_dtype(cfg, "float32"))
        renderer = ChatRenderer(tok, template_kwargs=cfg.data.chat_template_kwargs)  # as regenerate renders
    for p in weighable:
        row = rows[p["id"]]
        prompt = tok(renderer.render(row["conversations"][:-1], row.get("tools"), add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        answer = tok(row["conversations"][-1]["content"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ids = torch.tensor([prompt + answer], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(answer) - 1].float()
        top = logits.topk(2, dim=-1)
        gaps = top.values[:, 0] - top.values[:, 1]
        pick = int(top.indices[p["at"], 0])
        p.update(fp32_gap=round(float(gaps[p["at"]]), 4),
                 fp32_picks="ours" if pick == p["ours_token"] else "reference" if pick == p["reference_token"]
                 else "neither",
                 smaller_gaps_share=round(float((gaps < gaps[p["at"]]).float().mean()), 3),
                 answer_median_gap=round(float(gaps.median()), 4))
    picks = [p["fp32_picks"] for p in weighable]
    return {"weighed": len(weighable),
            "median_gap_at_parting": statistics.median([p["fp32_gap"] for p in weighable]) if weighable else None,
            "median_gap_in_answers": statistics.median([p["answer_median_gap"] for p in weighable])
            if weighable else None,
            "in_lowest_5pct_of_their_answer": sum(p["smaller_gaps_share"] <= 0.05 for p in weighable),
            "fp32_picks": {k: picks.count(k) for k in ("ours", "reference", "neither")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--answers", type=int, default=20000)
    ap.add_argument("--sample", type=int, default=64, help="prompts answered by hf too, to compare")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1024, help="prompts per SGLang call (and per write)")
    ap.add_argument("--reference-dtype", choices=["float32", "bfloat16", "float16"],
                    help="the sample's dtype in transformers (default: the config's model.dtype)")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from specforge_core.config import load_config
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.decoding.answering import regenerate
    from specforge_core.drafts import check_config

    cfg = check_config(load_config(args.config, ["capture.device=cuda", *args.overrides]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sglang_run = regenerate(cfg, out / "answers-sglang.jsonl", files=[args.prompts], batch_size=args.batch_size,
                            max_new_tokens=args.answer_tokens, limit=args.answers, engine="sglang")
    print("sglang " + json.dumps(sglang_run), flush=True)
    dtype = args.reference_dtype or cfg.model.dtype
    reference = out / f"answers-hf-{dtype}.jsonl"
    hf_run = regenerate(in_dtype(cfg, dtype), reference, files=[args.prompts], batch_size=32,
                        max_new_tokens=args.answer_tokens, limit=args.sample, engine="hf")
    print("hf " + json.dumps(hf_run), flush=True)
    greedy = compare_answers(load_tokenizer(cfg), answers(out / "answers-sglang.jsonl"), answers(reference))
    greedy["why"] = parting_margins(cfg, rows_by_id(reference), greedy["partings"])
    result = {"sglang": sglang_run, "hf": {**hf_run, "dtype": dtype}, "greedy": greedy}
    print("RESULT " + json.dumps(result), flush=True)
    (out / "regenerate.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
