"""SpecForge 0.2.0's draft step alone: the peer's figure with nothing of ours in the process.

    python bench/gpu_peer_standalone.py --shape qwen3-8b --shapes 1x4096,4x2048
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/gpu_peer_standalone.py   # the bench's allocator
    python bench/gpu_peer_standalone.py --family dflash --dflash-layer-ids 1,9,17,25,33

Needs torch, transformers and the ``specforge==0.2.0`` wheel (``--no-deps``). Builds the peer's
modules with ``bench/gpu_reference.py`` (EAGLE3: SpecForge's ``LlamaForCausalLMEagle3`` +
``OnlineEagle3Model``, flex attention, its Triton loss, AdamW; DFlash: ``DFlashDraftModel`` +
``OnlineDFlashModel``) but imports nothing of ``specforge_core``, builds no target and leaves the
allocator as the environment says. ``bench/gpu_train.py``'s peer phase runs this script in a
process of its own with the allocator at its default: measured 2026-12-01, expandable segments
(the bench's own setting) cost the peer 19-20 % (its step empties the CUDA cache every forward). Per shape: ``--warmup`` steps, then ``--iters`` steps each timed by CUDA events
(median and mean), then ``--iters`` steps back to back with one synchronisation after them (as a
training loop runs them); prints the three tokens/s as ``key=value`` lines and a ``RESULT {json}``
line.

``--teacher compact`` times SpecForge's offline teacher instead (built per vocab chunk from the last
hidden state rather than read from full-vocab logits).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.gpu_reference import peer_dflash_step, peer_eagle3_step  # noqa: E402  (torch + transformers + specforge)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "llama3-8b"])
    ap.add_argument("--shapes", default="1x4096,4x2048", help="dense batch×seq shapes")
    ap.add_argument("--ttt-length", type=int, default=7)
    ap.add_argument("--vocab-d", type=int, default=32000)
    ap.add_argument("--teacher", default="full", choices=["full", "compact"])
    ap.add_argument("--family", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument("--dflash-layer-ids", default="1,9,17,25,33", help="captured target layers (= draft layers)")
    ap.add_argument("--dflash-block", type=int, default=16)
    ap.add_argument("--dflash-anchors", type=int, default=512)
    ap.add_argument("--dflash-mask", type=int, default=151669)
    ap.add_argument("--dflash-gamma", type=float, default=7.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of 2 steps per shape to this directory")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    out = {"shape": args.shape, "family": args.family, "teacher": args.teacher, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "warmup": args.warmup, "iters": args.iters}
    for text in args.shapes.split(","):
        b, t = (int(x) for x in text.split("x"))
        torch.cuda.reset_peak_memory_stats()
        if args.family == "dflash":
            layers = [int(x) for x in args.dflash_layer_ids.split(",")]
            step = peer_dflash_step(args.shape, b, t, num_layers=len(layers), block_size=args.dflash_block,
                                    num_anchors=args.dflash_anchors, mask_token_id=args.dflash_mask,
                                    target_layer_ids=layers, loss_decay_gamma=args.dflash_gamma)
        else:
            step = peer_eagle3_step(args.shape, b, t, args.ttt_length, args.vocab_d, teacher=args.teacher)
        if step is None:
            return 1
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):  # back to back, as a training loop runs them
            step()
        torch.cuda.synchronize()
        key = f"standalone_{b}x{t}"
        out[f"{key}_tokens_per_s_median"] = round(b * t / statistics.median(times), 1)
        out[f"{key}_tokens_per_s_mean"] = round(b * t / statistics.mean(times), 1)
        out[f"{key}_tokens_per_s_back_to_back"] = round(b * t * args.iters / (time.perf_counter() - t0), 1)
        out[f"{key}_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        for k in (f"{key}_tokens_per_s_median", f"{key}_tokens_per_s_mean", f"{key}_tokens_per_s_back_to_back",
                  f"{key}_peak_gib"):
            print(f"{k}={out[k]}", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            (Path(args.profile) / f"profile_peer_{key}.txt").write_text(table)
            print("\n".join(table.splitlines()[:28]), flush=True)
        del step
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
