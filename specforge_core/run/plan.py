"""The prompt plan: which rank trains which prompt, in which epoch and micro-step.

    plan = PromptPlan.build(N, seed=42, epochs=2, topology=Topology(world_size=4, tp_size=2, batch_size=4),
                            accumulation_steps=2)
    plan.save("runs/x/plan.json");  PromptPlan.load("runs/x/plan.json") == plan
    for batch in plan.island_batches(rank, start_sample=0): ...   # lazy, one TP-wide batch each

A pure, deterministic function of (dataset size, seed, epochs, the :class:`Topology` — world size,
``capture.tp_size``, batch size —, accumulation steps, max_steps):

- **Epoch order**: epoch ``e`` visits the prompts in ``torch.randperm(N)`` seeded ``seed + e``.
- **Kept prompts**: an epoch keeps the first ``steps_per_epoch × W·B·A`` prompts of its
  permutation (W = world size, B = batch size, A = accumulation steps) and drops the rest, so the
  tail never spills into the next epoch and no accumulation window straddles two epochs.
  ``W·B·A`` does not depend on ``tp_size``, so every TP layout of the same world keeps the same
  prompts — and, because islands stride the kept prompts, every global micro-step trains the same
  ``W·B`` prompts (``kept[s·W·B : (s+1)·W·B]``) whatever the TP layout.
- **Islands**: ``tp_size`` consecutive ranks form a target island (``run/topology.py``; each
  island is one SGLang TP group). Island ``i`` of ``I = W / tp_size`` takes the
  strided shard ``kept[i::I]``: equal sizes, a whole number of TP-wide batches of ``tp_size × B``.
- **TP peers**: micro-step ``s`` of island ``i`` is the TP-wide batch ``shard[s·tp·B : (s+1)·tp·B]``;
  TP peer ``r = rank % tp_size`` trains rows ``[r·B, (r+1)·B)`` of it.
- **Horizon**: ``total_optimizer_steps = min(steps_per_epoch × epochs, max_steps)``; finite plans
  train only whole optimizer steps. ``max_steps`` beyond the data horizon does not add epochs.

Every task has a stable id ``island{i:04d}-epoch{e:06d}-slot{s:09d}-prompt{p:09d}`` (slot = position
in the island's shard of that epoch). Resume is one cursor: the number of samples a rank has
trained; the iterator jumps there arithmetically, so skipped prompts are never read or captured.
"""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specforge_core.errors import ConfigError, ResumeError
from specforge_core.io import atomic_write_json
from specforge_core.run.topology import Topology

PLAN_FORMAT = "specforge-prompt-plan/1"


@dataclass(frozen=True, slots=True)
class PromptTask:
    """One prompt scheduled for one island: where it sits in the plan and which row it reads."""

    island: int
    epoch: int
    slot: int
    prompt_index: int

    @property
    def task_id(self) -> str:
        return (
            f"island{self.island:04d}-epoch{self.epoch:06d}"
            f"-slot{self.slot:09d}-prompt{self.prompt_index:09d}"
        )


@dataclass(frozen=True, slots=True)
class IslandBatch:
    """One TP-wide target batch: ``tp_size × batch_size`` tasks that an island captures together.

    ``micro_step`` counts this rank's micro-steps from the start of the run (0-based);
    ``local`` is the row range this rank trains.
    """

    epoch: int
    micro_step: int
    tasks: tuple[PromptTask, ...]
    local: slice

    @property
    def local_tasks(self) -> tuple[PromptTask, ...]:
        return self.tasks[self.local]


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The visiting order of epoch ``epoch``: ``randperm(N)`` from a CPU generator seeded seed+epoch."""
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(dataset_size, generator=gen)


def _digest(perm: torch.Tensor) -> str:
    return hashlib.sha256(perm.to(torch.int64).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class PromptPlan:
    """The recorded plan. Build it with :meth:`build`; every derived number is a property."""

    dataset_size: int
    seed: int
    epochs: int
    world_size: int
    tp_size: int
    batch_size: int
    accumulation_steps: int
    max_steps: int | None = None
    # sha256 of epoch 0's permutation: detects a torch whose randperm orders differently.
    permutation_sha256: str = field(default="", compare=False)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        dataset_size: int,
        *,
        seed: int,
        epochs: int,
        topology: Topology,
        accumulation_steps: int,
        max_steps: int | None = None,
    ) -> "PromptPlan":
        """Validate the layout and return the plan; raises ConfigError naming the field to change."""
        for name, value in (("training.num_epochs", epochs), ("training.accumulation_steps", accumulation_steps)):
            if value < 1:
                raise ConfigError(f"must be at least 1, got {value}", where=name, fix=f"set {name} ≥ 1")
        if max_steps is not None and max_steps < 1:
            raise ConfigError(f"must be at least 1, got {max_steps}", where="training.max_steps",
                              fix="remove training.max_steps or set it ≥ 1")
        world, batch = topology.world_size, topology.batch_size
        step = world * batch * accumulation_steps
        if dataset_size < step:
            raise ConfigError(
                f"the dataset has {dataset_size} prompts, fewer than one optimizer step needs "
                f"(world {world} × batch {batch} × accumulation {accumulation_steps} = {step})",
                where="training.batch_size",
                fix="add training data, or lower training.batch_size / training.accumulation_steps",
            )
        digest = _digest(epoch_permutation(dataset_size, seed, 0))
        plan = cls(dataset_size, seed, epochs, world, topology.tp_size, batch, accumulation_steps, max_steps, digest)
        object.__setattr__(plan, "_topology", topology)  # carried, not a recorded field
        return plan

    @classmethod
    def from_config(cls, cfg, dataset_size: int, *, topology: Topology) -> "PromptPlan":
        """The plan of a :class:`~specforge_core.config.RunConfig` over ``dataset_size`` prompts
        for the run's ``topology``."""
        t = cfg.training
        return cls.build(dataset_size, seed=t.seed, epochs=t.num_epochs, topology=topology,
                         accumulation_steps=t.accumulation_steps, max_steps=t.max_steps)

    # ---- derived numbers ---------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """The layout the plan was built for: the very object :meth:`build` was given (the flow's
        config's, or a rank's launch's), handed down from here."""
        return self._topology

    @property
    def num_islands(self) -> int:
        return self.topology.num_islands

    @property
    def island_batch_size(self) -> int:
        """Prompts in one TP-wide target batch (captured together by an island's TP peers)."""
        return self.topology.island_batch_size

    @property
    def samples_per_micro_step(self) -> int:
        """Prompts the whole world trains in one micro-step (W × B)."""
        return self.world_size * self.batch_size

    @property
    def samples_per_optimizer_step(self) -> int:
        """Prompts the whole world trains in one optimizer step (W × B × A)."""
        return self.samples_per_micro_step * self.accumulation_steps

    @property
    def local_samples_per_optimizer_step(self) -> int:
        """Samples one rank trains per optimizer step (B × A): the resume cursor's unit."""
        return self.batch_size * self.accumulation_steps

    @property
    def steps_per_epoch(self) -> int:
        """Whole optimizer steps in one epoch."""
        return self.dataset_size // self.samples_per_optimizer_step

    @property
    def prompts_per_epoch(self) -> int:
        """Prompts kept (trained) per epoch; the other ``dropped_per_epoch`` are skipped."""
        return self.steps_per_epoch * self.samples_per_optimizer_step

    @property
    def dropped_per_epoch(self) -> int:
        return self.dataset_size - self.prompts_per_epoch

    @property
    def micro_steps_per_epoch(self) -> int:
        return self.steps_per_epoch * self.accumulation_steps

    @property
    def data_optimizer_steps(self) -> int:
        """Optimizer steps the data allows over all epochs (before ``max_steps``)."""
        return self.steps_per_epoch * self.epochs

    @property
    def total_optimizer_steps(self) -> int:
        """The horizon: what the LR schedule and the progress bar count to."""
        if self.max_steps is None:
            return self.data_optimizer_steps
        return min(self.max_steps, self.data_optimizer_steps)

    @property
    def total_micro_steps(self) -> int:
        return self.total_optimizer_steps * self.accumulation_steps

    @property
    def local_samples_total(self) -> int:
        """Samples each rank trains over the whole plan."""
        return self.total_micro_steps * self.batch_size

    # ---- tasks -------------------------------------------------------------------------------

    def island_shard(self, island: int, epoch: int) -> list[int]:
        """Prompt indices island ``island`` trains in ``epoch``, in order (slot = list position)."""
        if not 0 <= island < self.num_islands:
            raise ValueError(f"island {island} out of range [0, {self.num_islands})")
        if not 0 <= epoch < self.epochs:
            raise ValueError(f"epoch {epoch} out of range [0, {self.epochs})")
        kept = epoch_permutation(self.dataset_size, self.seed, epoch)[: self.prompts_per_epoch]
        return kept[island :: self.num_islands].tolist()

    def island_batches(self, rank: int, *, start_sample: int = 0) -> Iterator[IslandBatch]:
        """Lazily yield this rank's TP-wide batches, from ``start_sample`` to the horizon.

        ``start_sample`` is the number of samples this rank has already trained (the resume
        cursor: optimizer steps done × ``local_samples_per_optimizer_step``); it must be a multiple
        of ``batch_size``. Only the current epoch's permutation is ever materialised, and skipped
        micro-steps are jumped over without producing their tasks.
        """
        place = self.topology.place(rank)
        if start_sample % self.batch_size or not 0 <= start_sample <= self.local_samples_total:
            raise ResumeError(
                f"start sample {start_sample} is not a multiple of the batch size {self.batch_size} "
                f"within [0, {self.local_samples_total}]",
                where="prompt plan",
                fix="resume from a checkpoint written by this plan (its samples count per rank)",
            )
        island, width, local = place.island, self.island_batch_size, place.local
        shard: list[int] = []
        shard_epoch = -1
        for micro in range(start_sample // self.batch_size, self.total_micro_steps):
            epoch, within = divmod(micro, self.micro_steps_per_epoch)
            if epoch != shard_epoch:
                shard, shard_epoch = self.island_shard(island, epoch), epoch
            first = within * width
            tasks = tuple(
                PromptTask(island, epoch, slot, shard[slot]) for slot in range(first, first + width)
            )
            yield IslandBatch(epoch=epoch, micro_step=micro, tasks=tasks, local=local)

    def local_lengths(self, lengths) -> torch.Tensor:
        """``[total_micro_steps, world_size, batch_size]``: the length of every sample each rank trains
        in each micro-step, given every prompt's length (``lengths[i]`` of prompt ``i``). The same
        assignment as :meth:`island_batches`, computed a whole epoch at a time (the dry run's
        tokens per micro-step)."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.shape != (self.dataset_size,):
            raise ValueError(f"{tuple(lengths.shape)} lengths for a plan over {self.dataset_size} prompts")
        islands, tp, batch = self.num_islands, self.tp_size, self.batch_size
        steps: list[torch.Tensor] = []
        for epoch in range(-(-self.total_micro_steps // self.micro_steps_per_epoch)):
            kept = epoch_permutation(self.dataset_size, self.seed, epoch)[: self.prompts_per_epoch]
            shards = kept.view(-1, islands).T  # row i = kept[i::islands], island i's shard in slot order
            per_island = lengths[shards].view(islands, self.micro_steps_per_epoch, tp, batch)
            steps.append(per_island.permute(1, 0, 2, 3).reshape(self.micro_steps_per_epoch, self.world_size, batch))
        return torch.cat(steps)[: self.total_micro_steps]

    # ---- record ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The plan record: inputs, derived numbers (for readers), and the permutation check."""
        record = {"format": PLAN_FORMAT, **asdict(self)}
        record["derived"] = {
            "num_islands": self.num_islands,
            "island_batch_size": self.island_batch_size,
            "samples_per_optimizer_step": self.samples_per_optimizer_step,
            "steps_per_epoch": self.steps_per_epoch,
            "prompts_per_epoch": self.prompts_per_epoch,
            "dropped_per_epoch": self.dropped_per_epoch,
            "total_optimizer_steps": self.total_optimizer_steps,
        }
        return record

    @classmethod
    def from_json(cls, record: dict, *, where: str = "plan.json", topology: Topology | None = None) -> "PromptPlan":
        """Rebuild a recorded plan and check it reproduces here (same format and permutation).
        ``topology``: the reader's layout (a rank's launch); a record of that layout carries this
        object, so a rank makes no second one. Without it (or for a record of another layout, which
        the reader then refuses by comparing plans) the layout is made from the record."""
        if record.get("format") != PLAN_FORMAT:
            raise ResumeError(
                f"unknown plan format {record.get('format')!r} (expected {PLAN_FORMAT!r})",
                where=where,
                fix="record the plan again with this version (a new run), or use the version that wrote it",
            )
        try:
            layout = (record["world_size"], record["tp_size"], record["batch_size"])
            if topology is None or layout != (topology.world_size, topology.tp_size, topology.batch_size):
                topology = Topology(*layout)
            plan = cls.build(record["dataset_size"], seed=record["seed"], epochs=record["epochs"], topology=topology,
                             accumulation_steps=record["accumulation_steps"], max_steps=record.get("max_steps"))
        except KeyError as e:
            raise ResumeError(f"the plan record has no {e.args[0]!r}", where=where,
                              fix="record the plan again (a new run)") from None
        if record.get("permutation_sha256") != plan.permutation_sha256:
            raise ResumeError(
                "this torch orders the epoch permutation differently from the one that recorded the plan",
                where=f"{where}: permutation_sha256",
                fix="resume with the torch version that recorded the plan",
            )
        return plan

    @property
    def key(self) -> str:
        """sha256 of the plan record: equal plans, equal keys (the Prefect cache key of record_plan)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write plan.json atomically (write a temporary file, then rename)."""
        return atomic_write_json(path, self.to_json(), durable=True)

    @classmethod
    def load(cls, path: str | Path, *, topology: Topology | None = None) -> "PromptPlan":
        """The plan recorded at ``path`` (see :meth:`from_json` for ``topology``)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")), where=str(path), topology=topology)

    def differences(self, other: "PromptPlan") -> list[str]:
        """``field: recorded → now`` for every input that differs (empty: the same plan)."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} → {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
