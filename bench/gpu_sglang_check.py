"""SGLang capture on a GPU, checked against the hf backend, then trained through, then timed.

    python bench/gpu_sglang_check.py --prepare .gpu          # on a CPU machine: tiny target + data + caches
    python bench/gpu_sglang_check.py --out DIR               # on the GPU node (sglang==0.5.14 installed)
    python bench/gpu_sglang_check.py --phases agree-llama,train --out DIR

Phases (each in a process of its own: one SGLang engine per process):

- ``agree-llama`` / ``agree-qwen3``: a small random Llama / Qwen3 (bf16, GPU-friendly shapes) is
  saved, the same packed TP-wide batch is captured through ``capture.backend=sglang`` (our seam,
  ``capture/sglang_engine.py``) and through ``hf``; per captured layer and for the last hidden,
  the minimum cosine over tokens, and the teacher's argmax agreement (``last @ lm_head^T``).
  Pass: cosine ≥ 0.999, and argmax agreement ≥ 99 % or, where bf16 near-ties split the two paths,
  SGLang as faithful to the float32 target as hf (its argmax agreement with float32 at most one
  point below hf's) with the split tokens' float32 top-2 gap under a tenth of the typical one.
- ``train``: ``python -m specforge_core.train`` with ``capture.backend=sglang`` on the tiny target
  and data ``--prepare`` built (no datasets package needed on the node): 20 steps, checkpoint at
  10, SIGKILL, resume, finish. Pass: finite losses, acc_0 rising (the draft learns), resumed at step 10.
- ``shape-qwen3-8b``: Qwen3-8B's shape with SGLang's ``load_format=dummy`` (random weights, no
  16 GB file): SGLang capture tokens/s next to our hf capture (packed; plain, then with
  ``training.compile``'s compiled norms and MLPs) of the same batches.
- ``peer-qwen3-8b``: SpecForge 0.2.0's own SGLang capture (``OfflineSGLangCaptureBackend``, the
  wheel installed with ``--no-deps``) of the same batches at the same engine settings, fed padded
  batches and one sample per call; the better counts.

The agreement phases also measure both bf16 paths against the target in float32: on random
weights many teacher argmaxes are near-ties that a bf16 rounding flips in either path.

Every result is a ``RESULT {json}`` line and lands in ``DIR/sglang_check.json``.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=4096)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def save_random_target(out: Path, arch: str, shape: dict, seed: int = 0, weights: bool = True) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    config = cls(**shape, torch_dtype="bfloat16", pad_token_id=0, eos_token_id=2, bos_token_id=1)
    config.architectures = ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    if not weights:
        config.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def run_config(target: Path, backend: str, *extra: str):
    from specforge_core.config import load_config

    return load_config(None, [
        f"model.target={target}", f"capture.backend={backend}", "capture.device=cuda", "model.dtype=bfloat16",
        "data.max_length=1024", "training.batch_size=8", "training.token_budget=4096",
        "capture.sglang.attention_backend=triton", "capture.sglang.mem_fraction_static=0.3", *extra,
    ])


def request(vocab: int, lengths: list[int], seed: int):
    import torch

    from specforge_core.capture.base import TargetRequest

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return TargetRequest.from_rows(ids, [[1] * n for n in lengths], slice(0, len(lengths)),
                                   task_ids=[f"t{i}" for i in range(len(lengths))], token_budget=4096)


def phase_agree(arch: str, out_dir: Path) -> None:
    import torch
    from torch.nn.functional import cosine_similarity

    from specforge_core.capture import build_capture_backend
    from specforge_core.run.topology import Topology
    from specforge_core.system.distributed import init_distributed

    init_distributed("cuda")
    target = save_random_target(out_dir / f"tiny-{arch}", arch, SMALL)
    req = request(SMALL["vocab_size"], [700, 320, 1000, 96, 512, 257, 64, 800], seed=1)
    hf = build_capture_backend(run_config(target, "hf"))
    want = hf.capture(req)
    head = hf.lm_head_weight.detach().clone()
    hf.close()
    del hf
    # the same target in float32: the reference both bf16 paths are measured against
    hf32 = build_capture_backend(run_config(target, "hf", "model.dtype=float32"))
    exact = hf32.capture(req).last_hidden.float()
    head32 = hf32.lm_head_weight.detach().float().clone()
    hf32.close()
    del hf32
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    sg_cfg = run_config(target, "sglang")
    sg = build_capture_backend(sg_cfg, topology=Topology.from_config(sg_cfg))
    start_s = time.perf_counter() - t0
    got = sg.capture(req)
    real = want.attention_mask.bool()
    h = want.last_hidden.shape[-1]
    layers = {}
    for j, layer in enumerate(sg.layer_ids):
        a, b = got.aux_hidden[..., j * h:(j + 1) * h][real].float(), want.aux_hidden[..., j * h:(j + 1) * h][real].float()
        layers[str(layer)] = float(cosine_similarity(a, b, dim=-1).min())
    last_g, last_w = got.last_hidden[real].float(), want.last_hidden[real].float()
    logits_g, logits_w = last_g @ head.float().T, last_w @ head.float().T
    logits_x = exact[real] @ head32.T
    top_g, top_w, top_x = logits_g.argmax(-1), logits_w.argmax(-1), logits_x.argmax(-1)
    argmax = (top_g == top_w).float().mean()
    # Random weights put many near-ties at the top of the teacher: a bf16 rounding flips them in
    # either path. The float32 target is the referee: SGLang is as faithful as hf when it agrees
    # with float32 as often; and the disagreements are ties when the float32 top-2 gap is tiny.
    top2 = logits_x.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    split = top_g != top_w
    faithful = float((top_g == top_x).float().mean()) >= float((top_w == top_x).float().mean()) - 0.01
    ties = not bool(split.any()) or float(gap[split].median()) < 0.1 * float(gap.median())
    ok = min(layers.values()) >= 0.999 and float(cosine_similarity(last_g, last_w, dim=-1).min()) >= 0.999 \
        and (float(argmax) >= 0.99 or (faithful and ties))
    result(phase=f"agree-{arch}", layer_ids=list(sg.layer_ids), min_cosine_per_layer=layers,
           min_cosine_last=float(cosine_similarity(last_g, last_w, dim=-1).min()),
           teacher_argmax_agreement=float(argmax),
           sglang_bf16_vs_hf_fp32_argmax=float((top_g == top_x).float().mean()),
           hf_bf16_vs_hf_fp32_argmax=float((top_w == top_x).float().mean()),
           fp32_top2_gap_median=float(gap.median()),
           fp32_top2_gap_median_where_split=float(gap[split].median()) if bool(split.any()) else None,
           tokens=int(real.sum()), engine_start_s=round(start_s, 1), ok=ok)
    sg.close()


def phase_train(gpu_dir: Path, out_dir: Path) -> None:
    manifest = gpu_dir / "runs" / "sglang" / "run.json"  # recorded by --prepare: the ranks open the caches by path
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "specforge_core.train", "--manifest", str(manifest)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    lines = []
    for line in first.stdout:
        lines.append(line)
        print("  | " + line, end="", flush=True)
        if "checkpoint step-00000010 saved" in line:
            os.killpg(first.pid, signal.SIGKILL)
            break
    first.wait(60)
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    print("".join("  | " + x + "\n" for x in second.stdout.splitlines()), end="")
    print(second.stderr[-3000:], end="")
    runs = gpu_dir / "runs" / "sglang"
    records = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()] if (runs / "metrics.jsonl").is_file() else []
    losses = [r["loss"] for r in records]
    acc = [r.get("acc_0", 0.0) for r in records]
    ok = (second.returncode == 0 and "resumed from" in second.stdout and len(losses) == 20
          and all(math.isfinite(x) for x in losses) and sum(acc[-5:]) > sum(acc[:5]))
    result(phase="train", returncode=second.returncode, resumed="resumed from" in second.stdout, steps=len(losses),
           first_losses=losses[:3], last_losses=losses[-3:], first_acc_0=acc[:3], last_acc_0=acc[-3:],
           capture_tokens_per_s=records[-1].get("capture_tokens_per_s") if records else None,
           peak_mem_allocated_gib=round(records[-1].get("peak_mem_allocated_bytes", 0) / 2**30, 2) if records else None,
           ok=ok)


def shape_batches(out_dir: Path, steps: int):
    """The Qwen3-8B-shape target (config only: SGLang's dummy weights) and the 2 warm-up + ``steps``
    timed batches both the seam and the peer capture: (target dir, requests, tokens per batch)."""
    target = save_random_target(out_dir / "qwen3-8b-shape", "qwen3", QWEN3_8B, weights=False)
    reqs = [request(QWEN3_8B["vocab_size"], [1024, 700, 900, 300, 1024, 512, 800, 600], seed=s) for s in range(steps + 2)]
    return target, reqs, sum(len(r) for r in reqs[0].input_ids)


def phase_shape(out_dir: Path, steps: int = 5) -> None:
    import torch

    from specforge_core.system.distributed import init_distributed

    init_distributed("cuda")
    target, reqs, tokens = shape_batches(out_dir, steps)

    def timed(backend) -> float:
        for r in reqs[:2]:
            del_batch = backend.capture(r)
            del del_batch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for r in reqs[2:]:
            b = backend.capture(r)
            del b
        torch.cuda.synchronize()
        return tokens * steps / (time.perf_counter() - t0)

    from transformers import AutoConfig

    from specforge_core.capture.sglang_backend import SGLangEngineArgs
    from specforge_core.capture.sglang_backend import SGLangCaptureBackend
    from specforge_core.capture.sglang_engine import ModelRunnerEngine
    from specforge_core.run.topology import Topology

    cfg = run_config(target, "sglang", "capture.sglang.extra={load_format: dummy}")
    topology = Topology.from_config(cfg)
    layer_ids = (1, 17, 32)  # EAGLE3's default for 36 layers
    t0 = time.perf_counter()
    engine = ModelRunnerEngine.start(SGLangEngineArgs.resolve(cfg, topology), layer_ids, place=topology.place(0),
                                     device=torch.device("cuda", 0), islands=topology.islands())
    start_s = time.perf_counter() - t0
    # no checkpoint to read the head from: the timing needs none (the teacher is not computed here)
    head = torch.empty(QWEN3_8B["vocab_size"], QWEN3_8B["hidden_size"], device="cuda", dtype=torch.bfloat16)
    sg = SGLangCaptureBackend(engine, AutoConfig.from_pretrained(target), head, head)
    sglang_tps = timed(sg)
    result(phase="shape-qwen3-8b", sglang_capture_tokens_per_s=round(sglang_tps), sglang_engine_start_s=round(start_s, 1),
           tokens_per_capture=tokens)
    sg.close()
    del sg
    torch.cuda.empty_cache()
    from transformers import AutoModelForCausalLM

    from specforge_core.capture.hf import HFCaptureBackend

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target), dtype=torch.bfloat16)
    hf = HFCaptureBackend(model, layer_ids)
    hf_tps = timed(hf)
    result(phase="shape-qwen3-8b-hf", hf_capture_tokens_per_s=round(hf_tps), sglang_over_hf=round(sglang_tps / hf_tps, 3))
    hf.close()
    # training.compile's capture: the same model with its norms and MLPs compiled (compiles in the warm-ups)
    hfc = HFCaptureBackend(model, layer_ids, compile=True)
    timed(hfc)  # first pass: the compile itself, several shapes
    hfc_tps = timed(hfc)
    result(phase="shape-qwen3-8b-hf-compiled", hf_compiled_capture_tokens_per_s=round(hfc_tps),
           sglang_over_hf_compiled=round(sglang_tps / hfc_tps, 3))


def phase_peer_capture(out_dir: Path, steps: int = 5) -> None:
    """SpecForge 0.2.0's own SGLang capture (``OfflineSGLangCaptureBackend``, its wheel, ``--no-deps``)
    of the same batches at the same engine settings, in a process of its own. Two ways of feeding
    it, the better one counts: the padded batch its prepare script builds (pads are computed), and
    one sample per call (no pads, no batching)."""
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    shim = _without_dp_attention()
    from specforge.distributed import init_distributed
    from specforge.offline_capture.sglang_backend.capture import OfflineSGLangCaptureBackend

    from specforge_core.capture.sglang_backend import SGLangEngineArgs
    from specforge_core.run.topology import Topology

    init_distributed(tp_size=1)
    target, reqs, tokens = shape_batches(out_dir, steps)
    cfg = run_config(target, "sglang", "capture.sglang.extra={load_format: dummy}")
    # our engine's settings, less what the peer sets itself
    own = {"model_path", "dtype", "trust_remote_code", "enable_return_hidden_states", "disable_cuda_graph",
           "chunked_prefill_size", "tp_size", "pp_size"}
    kwargs = {k: v for k, v in SGLangEngineArgs.resolve(cfg, Topology.from_config(cfg)).kwargs().items() if k not in own}
    t0 = time.perf_counter()
    peer = OfflineSGLangCaptureBackend.build(str(target), torch_dtype="bfloat16", **kwargs)
    start_s = time.perf_counter() - t0
    peer.set_eagle3_capture_layers([1, 17, 32])

    def padded(r):
        n = max(len(x) for x in r.input_ids)
        ids = torch.zeros(len(r.input_ids), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(r.input_ids):
            ids[i, :len(x)] = torch.as_tensor(x)
            mask[i, :len(x)] = 1
        return [(ids.cuda(), mask.cuda())]

    def single(r):
        return [(torch.as_tensor([x]).cuda(), torch.ones(1, len(x), dtype=torch.long).cuda()) for x in r.input_ids]

    def timed(feed) -> float:
        batches = [feed(r) for r in reqs]
        for parts in batches[:2]:
            for ids, mask in parts:
                peer.capture(input_ids=ids, attention_mask=mask, loss_mask=mask)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for parts in batches[2:]:
            for ids, mask in parts:
                out = peer.capture(input_ids=ids, attention_mask=mask, loss_mask=mask)
                del out
        torch.cuda.synchronize()
        return tokens * steps / (time.perf_counter() - t)

    pad_tps, one_tps = timed(padded), timed(single)
    result(phase="peer-qwen3-8b", specforge_capture_padded_tokens_per_s=round(pad_tps),
           specforge_capture_per_sample_tokens_per_s=round(one_tps),
           specforge_capture_best_tokens_per_s=round(max(pad_tps, one_tps)), specforge_engine_start_s=round(start_s, 1),
           tokens_per_capture=tokens, engine_kwargs=sorted(kwargs), dp_attention_shim=shim)


def _without_dp_attention() -> bool:
    """The peer's capture module imports SGLang's DP-attention batch preparation, whose import chain
    reaches flashinfer's ``cuda.tile`` kernels, which the trimmed kit leaves out. The peer calls it
    only with DP attention (``require_mlp_sync``), off here: where the import fails, a stand-in that
    refuses to run takes its place. True when the stand-in was needed."""
    import types

    name = "sglang.srt.managers.scheduler_components.dp_attn"
    try:
        __import__(name)
        return False
    except ModuleNotFoundError as e:
        print(f"peer: {name} does not import here ({e}); DP attention is off, so a refusing stand-in takes its place")

    def prepare_mlp_sync_batch_raw(*args, **kwargs):
        raise RuntimeError("DP attention is not available in this SGLang kit")

    stub = types.ModuleType(name)
    stub.prepare_mlp_sync_batch_raw = prepare_mlp_sync_batch_raw
    sys.modules[name] = stub
    return True


def prepare(gpu_dir: Path) -> None:
    """Build, on a CPU machine, what the train phase reads: tiny target, data, prompt cache, vocab map."""
    import yaml

    from fixtures.chitchat import write_chitchat_jsonl
    from fixtures.tiny import build_tiny_target
    from specforge_core.prepare import main as prepare_main

    gpu_dir.mkdir(parents=True, exist_ok=True)
    rel = gpu_dir.resolve().relative_to(ROOT)
    target = build_tiny_target(gpu_dir / "tiny-llama", arch="llama", hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    import torch
    from transformers import AutoModelForCausalLM

    # bf16 on disk: half the bytes to carry to the GPU node, the dtype the run computes in there
    AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).save_pretrained(target)
    write_chitchat_jsonl(gpu_dir / "chat.jsonl", 400)
    cfg = {
        "model": {"target": str(rel / "tiny-llama"), "dtype": "bfloat16"},
        "data": {"train_files": [str(rel / "chat.jsonl")], "max_length": 256, "cache_dir": str(rel / "cache")},
        # sdpa: no flex-attention compile in each of the two launches (the check is the capture, not speed)
        "draft": {"draft_vocab_size": 256, "attention_backend": "sdpa"},
        "training": {"max_steps": 20, "batch_size": 8, "learning_rate": 1e-3, "warmup_ratio": 0.0, "ttt_length": 3,
                     "log_interval": 1, "save_interval": 10, "token_budget": 2048},
        "capture": {"backend": "sglang", "device": "cuda",
                    "sglang": {"attention_backend": "triton", "mem_fraction_static": 0.3}},
        "output": {"dir": str(rel / "runs" / "sglang")},
    }
    (gpu_dir / "train-sglang.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    hf = json.loads(json.dumps(cfg))
    hf["capture"] = {"backend": "hf", "device": "cpu"}
    hf["model"]["dtype"] = "float32"
    hf["output"]["dir"] = str(rel / "runs" / "hf-cpu")
    (gpu_dir / "train-hf-cpu.yaml").write_text(yaml.safe_dump(hf, sort_keys=False))
    assert prepare_main(["--config", str(gpu_dir / "train-hf-cpu.yaml")]) == 0
    # TP ≥ 2 layouts, recorded for a machine with 2 or 4 GPUs (docs/performance.md has the commands)
    for name, world in (("sglang-tp2", 2), ("sglang-2x2", 4)):
        layout = json.loads(json.dumps(cfg))
        layout["capture"]["tp_size"] = 2
        layout["deployment"] = {"nproc_per_node": world}
        layout["output"]["dir"] = str(rel / "runs" / name)
        (gpu_dir / f"train-{name}.yaml").write_text(yaml.safe_dump(layout, sort_keys=False))
    for name in ("sglang", "hf-cpu", "sglang-tp2", "sglang-2x2"):
        record_manifest(gpu_dir / f"train-{name}.yaml")


def record_manifest(config_path: Path) -> Path:
    """What the flow's stages record before training: the plan and run.json, by path and key."""
    from specforge_core.capture.target_info import target_vocab_size
    from specforge_core.config import dump_config, load_config
    from specforge_core.data.prompt_cache import ensure_prompt_cache
    from specforge_core.data.tokenize import load_tokenizer
    from specforge_core.data.vocab import ensure_vocab_map
    from specforge_core.run.directory import RunDir
    from specforge_core.run.manifest import Ref, RunManifest
    from specforge_core.run.plan import PromptPlan
    from specforge_core.run.topology import Topology

    cfg = load_config(config_path)
    tokenizer = load_tokenizer(cfg)
    cache = ensure_prompt_cache(cfg, tokenizer)
    vocab = ensure_vocab_map(cfg, cache, target_vocab_size(cfg, tokenizer))
    run = RunDir(cfg.output.dir)
    plan = PromptPlan.from_config(cfg, len(cache.rows("train")), topology=Topology.from_config(cfg))
    plan.save(run.plan)
    return RunManifest(config=dump_config(cfg), prompt_cache=Ref(cache.key, str(cache.path)),
                       plan=Ref(plan.key, str(run.plan)), vocab_map=Ref(vocab.key, str(vocab.path))).save(run.manifest)


PHASES = ("agree-llama", "train", "agree-qwen3", "shape-qwen3-8b", "peer-qwen3-8b")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", help="CPU side: build the train phase's inputs into this folder")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--gpu-dir", default=str(ROOT / ".gpu"))
    ap.add_argument("--out", default="/tmp/sglang-check")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per phase")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/sglang-check-work")
    if args.phase:
        {"agree-llama": lambda: phase_agree("llama", work), "agree-qwen3": lambda: phase_agree("qwen3", work),
         "train": lambda: phase_train(Path(args.gpu_dir), work),
         "shape-qwen3-8b": lambda: phase_shape(work), "peer-qwen3-8b": lambda: phase_peer_capture(work)}[args.phase]()
        return 0
    results = []
    for phase in args.phases.split(","):
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--gpu-dir", args.gpu_dir],
                                  capture_output=True, text=True, timeout=args.timeout)
            text = proc.stdout + proc.stderr
            code = proc.returncode
        except subprocess.TimeoutExpired as e:
            text, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        found = [json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")]
        results += found or [{"phase": phase, "error": text[-2500:]}]
        results[-1]["seconds"] = round(time.perf_counter() - t0, 1)
        results[-1]["exit"] = code
        print(f"== {phase} ({results[-1]['seconds']} s, exit {code})\n{text[-4000:]}", flush=True)
        (out / "sglang_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
