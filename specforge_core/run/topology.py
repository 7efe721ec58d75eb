"""The run's topology: how the world of ranks splits into target islands, and where each rank sits.

    topo = Topology.from_config(cfg)                    # world from deployment.*, or world_size=N
    topo = cfg.topology                                 # the one a validated RunConfig made
    topo = Topology.launched(cfg, world_size)           # cfg.topology, unless the launch has another size
    topo.num_islands, topo.island_batch_size            # W / tp, tp × batch_size
    place = topo.place(rank)                            # RankPlace(rank, island, tp_rank, island_ranks, local)

The one place these numbers are derived. ``capture.tp_size`` consecutive ranks form a target
island: island ``i`` holds ranks ``[i·tp, (i+1)·tp)``, which capture one TP-wide batch of
``tp × batch_size`` rows together (every TP peer runs the same target forward, or, with SGLang, its
shard of it) and each trains its own rows ``[tp_rank·B, (tp_rank+1)·B)``. Islands are
data-parallel replicas of the target with disjoint prompt shards (``run/plan.py``). The plan, the
capture backends, the SGLang engine arguments and the dry run all read a :class:`Topology`;
nothing else computes ``rank // tp`` or ``tp × batch``.
"""

from dataclasses import dataclass

from specforge_core.errors import ConfigError

TP_FIELD = "capture.tp_size"
WORLD_FIELD = "deployment.nproc_per_node × nnodes"


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one rank sits: its island, its rank inside the island's TP group, its rows."""

    rank: int
    island: int
    tp_rank: int
    island_ranks: tuple[int, ...]  # the torchrun ranks of this island's TP group, in TP order
    local: slice  # this rank's rows of the island's TP-wide batch


@dataclass(frozen=True, slots=True)
class Topology:
    """``world_size`` ranks in islands of ``tp_size``; ``batch_size`` samples per rank per micro-step."""

    world_size: int
    tp_size: int
    batch_size: int

    def __post_init__(self) -> None:
        for where, value in ((WORLD_FIELD, self.world_size), (TP_FIELD, self.tp_size),
                             ("training.batch_size", self.batch_size)):
            if value < 1:
                raise ConfigError(f"must be at least 1, got {value}", where=where, fix=f"set {where} ≥ 1")
        if self.world_size % self.tp_size:
            raise ConfigError(
                f"{TP_FIELD}={self.tp_size} must divide the world size ({WORLD_FIELD} = {self.world_size})",
                where=TP_FIELD,
                fix=f"change {TP_FIELD} to a divisor of {self.world_size}, or deployment.nproc_per_node",
            )

    @classmethod
    def from_config(cls, cfg, world_size: int | None = None) -> "Topology":
        """The topology of a run config; ``world_size`` (torchrun's, or a dry run's) overrides the
        config's ``deployment.nproc_per_node × nnodes``."""
        world = cfg.deployment.world_size if world_size is None else world_size
        return cls(world, cfg.capture.tp_size, cfg.training.batch_size)

    @classmethod
    def launched(cls, cfg, world_size: int) -> "Topology":
        """The topology of a launch of ``world_size`` ranks (torchrun's world, or a dry run's
        ``--world``): the config's own (``cfg.topology``, made by its validation; no other is made),
        ConfigError naming ``deployment.nproc_per_node`` unless ``world_size`` is the config's."""
        if world_size != cfg.deployment.world_size:
            raise ConfigError(
                f"{world_size} ranks are launched (torchrun's world, or a dry run's --world) but the config plans for "
                f"{WORLD_FIELD} = {cfg.deployment.world_size}",
                where="deployment.nproc_per_node",
                fix=f"set deployment.nproc_per_node (× nnodes) to {world_size}, or launch that many ranks",
            )
        return cfg.topology

    @property
    def num_islands(self) -> int:
        return self.world_size // self.tp_size

    @property
    def island_batch_size(self) -> int:
        """Rows of one TP-wide target batch (captured together by an island's TP peers)."""
        return self.tp_size * self.batch_size

    def place(self, rank: int) -> RankPlace:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")
        island, tp_rank = divmod(rank, self.tp_size)
        first = island * self.tp_size
        return RankPlace(
            rank=rank,
            island=island,
            tp_rank=tp_rank,
            island_ranks=tuple(range(first, first + self.tp_size)),
            local=slice(tp_rank * self.batch_size, (tp_rank + 1) * self.batch_size),
        )

    def islands(self) -> list[tuple[int, ...]]:
        """Every island's ranks, in island order (what SGLang's per-island TP groups are built from)."""
        return [self.place(i * self.tp_size).island_ranks for i in range(self.num_islands)]

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "tp_size": self.tp_size, "num_islands": self.num_islands,
                "batch_size": self.batch_size, "island_batch_size": self.island_batch_size}
