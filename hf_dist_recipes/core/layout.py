"""Which ranks form which group: tensor-parallel (TP), expert-parallel (EP) and data-parallel (DP), in one place.

DeepSpeed 0.19.8 forms AutoTP groups of consecutive ranks ([0, 1], [2, 3] for TP 2) and the data-parallel replicas
across them (rank r is replica r // tp); its expert-parallel groups are runs of `ep` consecutive members of a
data-parallel group (`groups._get_expert_parallel_ranks`, without AutoTP folding). Every feature that asks "who are
my TP peers" or "which replica am I" asks this object, as torchtitan's `ParallelDims` answers it for its trainer,
instead of repeating the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """`world` ranks split into TP groups of `tp` consecutive ranks; `ep` is the expert-parallel degree (default 1).

    Raises ValueError when a size is below 1 or a degree does not divide the world, naming the DeepSpeed setting
    to change."""

    world: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.world < 1:
            raise ValueError(f"the world size must be >= 1 process, got {self.world}")
        for kind, degree, setting in (
            ("tensor-parallel", self.tp, "tensor_parallel.autotp_size"),
            ("expert-parallel", self.ep, "expert_parallel.autoep_size"),
        ):
            if degree < 1:
                raise ValueError(f"the {kind} degree must be >= 1, got {degree}; set {setting} to 1 or more")
            if self.world % degree:
                raise ValueError(
                    f"world size {self.world} is not divisible by the {kind} degree {degree}; launch a multiple "
                    f"of {degree} processes or change {setting}"
                )

    @property
    def dp(self) -> int:
        """Data-parallel replicas: world / tp."""
        return self.world // self.tp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel replica `rank` belongs to (its TP group's index)."""
        return rank // self.tp

    def tp_group(self, rank: int) -> list[int]:
        """The ranks of `rank`'s TP group, itself included."""
        start = rank - rank % self.tp
        return list(range(start, start + self.tp))

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        """The global rank of TP rank `tp_rank` in data-parallel replica `dp_rank` (DeepSpeed's checkpoint files
        name ranks by this pair)."""
        return dp_rank * self.tp + tp_rank

    def dp_group(self, rank: int) -> list[int]:
        """The ranks that hold `rank`'s TP shard, one per replica, itself included: its data-parallel group (what
        ZeRO partitions over under TP)."""
        return list(range(rank % self.tp, self.world, self.tp))

    def ep_group(self, rank: int) -> list[int]:
        """The ranks of `rank`'s expert-parallel group (each a share of the experts), itself included."""
        dp = self.dp_group(rank)
        start = dp.index(rank) // self.ep * self.ep
        return dp[start : start + self.ep]

    def tp_groups(self) -> list[list[int]]:
        """Every TP group, in order: [[0, .., tp-1], [tp, .., 2tp-1], ...]."""
        return [self.tp_group(start) for start in range(0, self.world, self.tp)]
