"""Test harness for the trainer's runtime: real gloo ranks in forked processes, a tiny draft.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT) on top of this process's
environment at the call, calls ``fn(rank, *args)`` in each and returns what each returned (rank
order). ``fn`` must be a module-level function of an importable module; results travel through
``torch.save`` files. The processes come from ``rank_context()``: forked from multiprocessing's
fork server, which has imported torch and this harness once, so a rank starts without importing
torch again (a fresh interpreter's imports are most of a small rank's CPU). The
rendezvous store is served from this process, as torchrun's agent serves it: it binds port 0 and
holds the port it got until the ranks are done, so no other process can take it in between. A
rank leaves with ``exit_after_success()`` once its result is saved (exit code 0, no interpreter
teardown: see that function).

``write_draft_files`` stores a draft state the plain way (``draft.safetensors`` + a config); the
trainer passes the export module's writer for the EAGLE3 draft.

``TinyDraft`` has the draft's shape in miniature (frozen embedding, fc, one layer, norm, lm_head,
a d2t buffer) and ``TinyStep`` is the root a trainer shards: its forward computes a loss by
calling the draft's methods and submodules (not its ``forward``), as the EAGLE3 objective does.
"""

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn

from specforge_core.system.distributed import exit_after_success


# What the fork server imports before it forks any rank: what every rank function needs.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
           "safetensors.torch", "pytest", "transformers.modeling_utils", "specforge_core.loop.trainer",
           "specforge_core.capture.hf", "specforge_core.drafts.eagle3", "tests.runtime.harness"]


def rank_context():
    """multiprocessing's forkserver context, its server preloading ``PRELOAD``.

    A process it starts inherits the fork server's environment (taken when the server started),
    not the caller's: pass what the child must see explicitly, as ``run_ranks`` does."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank a client of run_ranks' store
    )
    torch.set_num_threads(1)
    result = fn(rank, *args)
    torch.save(result, Path(out_dir) / f"result-{rank}.pt")
    # The result is saved: leave with 0 now, not through the interpreter's teardown, where a gloo
    # worker thread still releasing the last collective can abort the rank (SIGABRT, exit -6;
    # exit_after_success says why). A rank that raised never gets here and keeps spawn's exit 1.
    exit_after_success()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; re-raise a rank's failure here."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ranks-") as out:
        rank_context()  # the fork server's preload, set before the server first starts
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, store.port, out, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout_s}s")
        return [torch.load(Path(out) / f"result-{r}.pt", weights_only=False) for r in range(world_size)]


class TinyDraft(nn.Module):
    """Frozen embedding, fc, one layer, norm, lm_head, a d2t buffer: the draft's parts in miniature."""

    def __init__(self, vocab: int = 32, hidden: int = 8, draft_vocab: int = 12):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = nn.Sequential(nn.Linear(2 * hidden, 4 * hidden), nn.SiLU(), nn.Linear(4 * hidden, hidden))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.arange(draft_vocab) * 2)

    def advance(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One unrolled step's layer (a method, like the EAGLE3 layer's ``project_qkv``)."""
        return hidden + self.midlayer(torch.cat([embeds, hidden], dim=-1))


class TinyStep(nn.Module):
    """Root of the training step: a two-step unroll over the draft, soft-target CE."""

    def __init__(self, draft: TinyDraft):
        super().__init__()
        self.draft = draft

    def forward(self, batch: dict) -> torch.Tensor:
        d = self.draft
        h = d.fc(batch["aux"].to(d.fc.weight.dtype))  # inputs stay in capture precision: cast here
        loss = 0.0
        for k in range(2):
            e = d.embed_tokens(batch["ids"].roll(-k, dims=1))
            h = d.advance(e, h)
            logits = d.lm_head(d.norm(h)).float()
            loss = loss + 0.8**k * -(batch["target"] * logits.log_softmax(-1)).sum(-1).mean()
        return loss


def tiny_batch(seed: int, batch: int = 4, seq: int = 6, hidden: int = 8, vocab: int = 32, draft_vocab: int = 12):
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(vocab, (batch, seq), generator=g),
        "aux": torch.randn(batch, seq, 3 * hidden, generator=g),
        "target": torch.randn(batch, seq, draft_vocab, generator=g).softmax(-1),
    }


def split_batch(batch: dict, parts: int, index: int) -> dict:
    return {k: v.chunk(parts)[index] for k, v in batch.items()}


def write_draft_files(directory: Path, state: dict) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, str(Path(directory) / "draft.safetensors"))
    (Path(directory) / "draft_config.json").write_text(json.dumps({"keys": sorted(state)}))
