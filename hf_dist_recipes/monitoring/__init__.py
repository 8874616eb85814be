"""Practice 7: TensorBoard on every rank, and per-rank numbers to compare ranks with."""

from hf_dist_recipes.monitoring.rank_metrics import RankMetrics
from hf_dist_recipes.monitoring.summary import RankSummaryCallback, read_rank_summaries
from hf_dist_recipes.monitoring.tensorboard import PerRankTensorBoardCallback, rank_log_dir, read_scalars

__all__ = ["PerRankTensorBoardCallback", "RankMetrics", "RankSummaryCallback", "rank_log_dir", "read_rank_summaries", "read_scalars"]
