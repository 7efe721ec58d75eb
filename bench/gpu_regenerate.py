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
answer token they part: in bf16 two engines' kernels round differently, and one near-tied argmax
is enough to send the rest of an answer elsewhere. Prints ``RESULT {json}`` and writes
``DIR/regenerate.json`` (the answers stay in ``DIR``).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def answers(path: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return {row["id"]: row["conversations"][-1]["content"] for row in rows}


def compare_answers(tok, ours: dict[str, str], reference: dict[str, str]) -> dict:
    """Same answers, and where the others part (answer-token index of the first difference)."""
    same, parted = 0, []
    for key, text in reference.items():
        a, b = (tok(t, add_special_tokens=False)["input_ids"] for t in (ours[key], text))
        if a == b:
            same += 1
            continue
        parted.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"compared": len(reference), "same": same, "differ": len(parted),
            "first_difference_at_tokens": sorted(parted)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--answers", type=int, default=20000)
    ap.add_argument("--sample", type=int, default=64, help="prompts answered by hf too, to compare")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1024, help="prompts per SGLang call (and per write)")
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
    hf_run = regenerate(cfg, out / "answers-hf.jsonl", files=[args.prompts], batch_size=32,
                        max_new_tokens=args.answer_tokens, limit=args.sample, engine="hf")
    print("hf " + json.dumps(hf_run), flush=True)
    result = {"sglang": sglang_run, "hf": hf_run,
              "greedy": compare_answers(load_tokenizer(cfg), answers(out / "answers-sglang.jsonl"),
                                answers(out / "answers-hf.jsonl"))}
    print("RESULT " + json.dumps(result), flush=True)
    (out / "regenerate.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
