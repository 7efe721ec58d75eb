"""Checkpoints: atomic step directories, a ``latest`` pointer, keep-N, verified loads, resume checks.

Layout (``<output.dir>/checkpoints/``)::

    step-00000012/
        draft_config.json    the draft's config         } written by the caller's ``write_draft_files``
        draft.safetensors    full draft state dict      } (the export module owns this format): fp32
                                                          masters, d2t/t2d, no frozen embedding
        train_state.json     counters (optimizer steps, consumed samples), the resume contract, ...
        rank-00000.pt ...    per rank: sharded AdamW state, scheduler, RNG
        COMPLETE             written last: sha256 of every file above
    latest                   text: the name of the newest complete step directory

Every rank writes into ``.step-00000012.tmp``; rank 0 writes COMPLETE, renames the directory to
its final name, then replaces ``latest``. A crash at any point leaves either the previous
checkpoints untouched or a new complete one: a directory without COMPLETE is torn and ignored.
The run directory must be one filesystem that every rank sees (one node, or a shared mount).

Loading verifies the checksum of every file a rank reads and refuses a corrupt checkpoint with
CheckpointError naming the file. :func:`check_resume` compares the contract recorded in a
checkpoint with the current run's and raises ResumeError listing every difference.
All functions taking a ``Dist`` are collective: every rank calls them in the same order.
"""

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from specforge_core.errors import CheckpointError, ResumeError
from specforge_core.io import atomic_write_text, fsync_dir, fsync_file, sha256_file, write_durably
from specforge_core.run.directory import RunDir
from specforge_core.system.distributed import Dist, all_gather_object, barrier

FORMAT_VERSION = 1
DRAFT_CONFIG = "draft_config.json"
DRAFT_WEIGHTS = "draft.safetensors"
TRAIN_STATE = "train_state.json"
COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).checkpoints


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(path: str | Path) -> int | None:
    """The optimizer step of a checkpoint directory ``.../step-00000100`` (None for any other path)."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------
# Files


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Step directories that carry a COMPLETE marker, oldest first (torn ones are skipped)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None.

    Decided by the COMPLETE markers, not by ``latest``: the pointer is replaced after the rename,
    so a crash in between leaves it one checkpoint behind a checkpoint that is nevertheless whole.
    """
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def verify_files(ckpt: Path, names: list[str]) -> None:
    """Check ``names`` in ``ckpt`` against the sha256 sums in its COMPLETE marker."""
    marker = ckpt / COMPLETE
    if not marker.is_file():
        raise CheckpointError(
            "checkpoint has no COMPLETE marker (torn: the save did not finish)",
            where=str(ckpt),
            fix="resume from an earlier checkpoint: delete this directory",
        )
    try:
        sums = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(
            "COMPLETE marker is not readable JSON with a 'files' table",
            where=str(marker),
            fix=f"delete {ckpt} to resume from the previous checkpoint",
        ) from None
    for name in names:
        path = ckpt / name
        if name not in sums:
            raise CheckpointError(
                f"{name} is not listed in COMPLETE (saved by a different world size or format?)",
                where=str(path),
                fix=f"resume with the checkpoint's world size, or delete {ckpt} to resume from the previous one",
            )
        if not path.is_file():
            raise CheckpointError(
                f"{name} is missing from the checkpoint",
                where=str(path),
                fix=f"restore the file, or delete {ckpt} to resume from the previous checkpoint",
            )
        if sha256_file(path) != sums[name]:
            raise CheckpointError(
                f"{name} does not match its sha256 in COMPLETE (corrupt or modified after the save)",
                where=str(path),
                fix=f"restore the file, or delete {ckpt} to resume from the previous checkpoint",
            )


def _collective_check(d: Dist, error: CheckpointError | None) -> None:
    """Raise on every rank if any rank failed, so no rank is left waiting in a collective."""
    errors = [e for e in all_gather_object(d, None if error is None else str(error)) if e]
    if error is not None:
        raise error
    if errors:
        raise CheckpointError(f"another rank failed: {errors[0]}")


# ---------------------------------------------------------------------------------------------
# State pieces


def _frozen_names(draft: nn.Module) -> set[str]:
    return {name for name, p in draft.named_parameters() if not p.requires_grad}


def _to_local(tree: Any) -> Any:
    """Replace DTensors by this rank's local shard (on CPU) so the tree pickles without a mesh."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().cpu()
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_local(v) for v in tree]
    return tree


def _optimizer_state(draft: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    osd = get_optimizer_state_dict(draft, optimizer, options=StateDictOptions(full_state_dict=False))
    return _to_local(osd)


def _restore_optimizer(draft: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    params = dict(draft.named_parameters())
    state = {}
    for fqn, slots in saved["state"].items():
        p = params[fqn]
        state[fqn] = {
            k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
            else v
            for k, v in slots.items()
        }
    osd = {"state": state, "param_groups": saved["param_groups"]}
    set_optimizer_state_dict(draft, optimizer, osd, options=StateDictOptions(full_state_dict=False))


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------
# Save


def save_checkpoint(
    run_dir: str | Path,
    d: Dist,
    *,
    step: int,
    draft: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    write_draft_files: Callable[[Path, dict[str, torch.Tensor]], None],
    train_state: dict,
    keep: int,
) -> Path:
    """Write ``step-<step>`` atomically, point ``latest`` at it, keep the newest ``keep``; collective.

    ``draft`` is the (sharded) draft module. Its full state without frozen parameters is gathered
    on rank 0 and handed to ``write_draft_files(directory, state)``, which must write
    ``draft_config.json`` and ``draft.safetensors`` there. ``train_state`` is stored as given,
    with ``step`` and the format version added. Returns the final directory.
    """
    root = checkpoints_dir(run_dir)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    if d.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(".step-*.tmp"), *root.glob(".step-*.deleting")]:  # a crashed save/delete
            shutil.rmtree(stale)
        for stale in root.glob(f".{LATEST}.*.tmp"):  # a crash while replacing the pointer
            stale.unlink(missing_ok=True)
        tmp.mkdir()
    barrier(d)

    weights = get_model_state_dict(
        draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    rank_state = {
        "optimizer": _optimizer_state(draft, optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(d.device),
        "rank": d.rank,
        "world_size": d.world_size,
    }
    written: dict[str, str] = {}
    error = None
    try:
        rank_path = tmp / rank_file_name(d.rank)
        torch.save(rank_state, rank_path)
        fsync_file(rank_path)
        written[rank_path.name] = sha256_file(rank_path)
        if d.is_main:
            leaked = sorted(set(weights) & _frozen_names(draft))
            assert not leaked, f"frozen parameters in the saved state: {leaked}"
            write_draft_files(tmp, weights)
            state = {**train_state, "step": step, "format": FORMAT_VERSION}
            write_durably(tmp / TRAIN_STATE, json.dumps(state, indent=2, sort_keys=True))
            for path in tmp.iterdir():
                if not path.name.startswith(("rank-", ".")):  # rank files are hashed by their ranks
                    fsync_file(path)
                    written[path.name] = sha256_file(path)
    except OSError as e:
        error = CheckpointError(
            f"could not write the checkpoint: {e}", where=str(tmp), fix="free disk space or fix permissions"
        )
    del weights, rank_state
    sums: dict[str, str] = {}
    for part in all_gather_object(d, written if error is None else None):
        if part is None and error is None:
            error = CheckpointError("another rank could not write its checkpoint file", where=str(tmp))
        sums.update(part or {})
    if error is not None:
        raise error

    if d.is_main:
        write_durably(tmp / COMPLETE, json.dumps({"step": step, "files": dict(sorted(sums.items()))}, indent=2))
        fsync_dir(tmp)
        if final.exists():  # a re-save of the same step after resuming from an earlier one
            _remove_dir(final)
        os.rename(tmp, final)
        fsync_dir(root)
        atomic_write_text(root / LATEST, final.name + "\n", durable=True)
        for old in complete_checkpoints(run_dir)[:-keep]:
            _remove_dir(old)
    barrier(d)
    return final


def _remove_dir(path: Path) -> None:
    """Delete a checkpoint so that a crash midway never leaves a half-deleted one that looks complete.

    The rename to a dot-name is atomic; the leftover (if any) is swept by the next save.
    """
    aside = path.with_name(f".{path.name}.deleting")
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(path, aside)
    shutil.rmtree(aside)


# ---------------------------------------------------------------------------------------------
# Load


def read_train_state(ckpt: str | Path) -> dict:
    """The verified ``train_state.json`` of a checkpoint (counters, contract, ...)."""
    ckpt = Path(ckpt)
    verify_files(ckpt, [TRAIN_STATE])
    state = json.loads((ckpt / TRAIN_STATE).read_text(encoding="utf-8"))
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format {state.get('format')!r}, this version reads {FORMAT_VERSION}",
            where=str(ckpt / TRAIN_STATE),
            fix="resume with the version that wrote it, or start a fresh run in a new output.dir",
        )
    return state


def load_checkpoint(
    ckpt: str | Path,
    d: Dist,
    *,
    draft: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG from ``ckpt``; return train_state.

    Every rank verifies the files it reads first; if any is corrupt all ranks raise the same
    CheckpointError. Only the frozen parameters may be absent from the saved weights.
    """
    ckpt = Path(ckpt)
    rank_name = rank_file_name(d.rank)
    error = None
    try:
        verify_files(ckpt, [TRAIN_STATE, DRAFT_WEIGHTS, rank_name])
    except CheckpointError as e:
        error = e
    _collective_check(d, error)

    weights = load_file(str(ckpt / DRAFT_WEIGHTS))
    result = set_model_state_dict(draft, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    missing = sorted(set(result.missing_keys) - _frozen_names(draft))
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"saved weights do not fit this draft: missing {missing}, unexpected {sorted(result.unexpected_keys)}",
            where=str(ckpt / DRAFT_WEIGHTS),
            fix="resume with the draft config the checkpoint was trained with (see its draft_config.json)",
        )
    del weights
    rank_state = torch.load(ckpt / rank_name, map_location="cpu", weights_only=True)
    _restore_optimizer(draft, optimizer, rank_state["optimizer"])
    scheduler.load_state_dict(rank_state["scheduler"])
    _restore_rng(rank_state["rng"], d.device)
    return read_train_state(ckpt)


# ---------------------------------------------------------------------------------------------
# Resume contract


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def contract_differences(recorded: dict, current: dict) -> list[str]:
    """``field: checkpoint=X run=Y`` for every value that differs (nested keys dotted)."""
    old = _flatten(json.loads(json.dumps(recorded)))
    new = _flatten(json.loads(json.dumps(current)))

    def show(values: dict, key: str) -> str:
        return repr(values[key]) if key in values else "<absent>"

    return [
        f"{key}: checkpoint={show(old, key)} run={show(new, key)}"
        for key in sorted(set(old) | set(new))
        if key not in old or key not in new or old[key] != new[key]
    ]


def check_resume(recorded: dict, current: dict, *, where: str) -> None:
    """Raise ResumeError naming every difference between the recorded and the current contract."""
    diffs = contract_differences(recorded, current)
    if diffs:
        target = ""
        if any(d.startswith("identities.target:") for d in diffs):
            target = ("identities.target is the sha256 of model.target's files (weights, config, "
                      "tokenizer): point model.target at the files the checkpoint was trained on; ")
        raise ResumeError(
            "this run differs from the checkpoint it would resume, so it would train the wrong "
            "prompts or state:\n    " + "\n    ".join(diffs),
            where=where,
            fix=target + "resume with the recorded values (same config, data, plan and world size), or "
            "start a fresh run in a new output.dir",
        )


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A step directory as given, or the newest one of a run directory (``checkpoints/latest``)."""
    path = Path(path)
    if (path / DRAFT_CONFIG).exists():
        return path
    for checkpoints in (path / "checkpoints", path):
        latest = checkpoints / "latest"
        if latest.is_file():
            step = checkpoints / latest.read_text().strip()
            if (step / DRAFT_CONFIG).exists():
                return step
            raise CheckpointError(
                f"checkpoints/latest names {step.name}, which has no {DRAFT_CONFIG}",
                where=str(latest),
                fix="point --checkpoint at a complete step directory",
            )
    raise CheckpointError(
        f"neither a checkpoint step directory ({DRAFT_CONFIG}) nor a run directory (checkpoints/latest)",
        where=str(path),
        fix="pass a run directory or one of its checkpoints/step-* directories",
    )
