"""Practice 7: TensorBoard on every rank, and per-rank numbers to compare ranks with.

Names are imported on first use, so reading a finished run's summaries does not import transformers.
"""

from hf_dist_recipes.core.public_names import lazy_names

_PUBLIC = {
    "PerRankTensorBoardCallback": "hf_dist_recipes.monitoring.tensorboard",
    "rank_log_dir": "hf_dist_recipes.monitoring.tensorboard",
    "read_scalars": "hf_dist_recipes.logs.events",
    "read_texts": "hf_dist_recipes.logs.events",
    "RankMetrics": "hf_dist_recipes.monitoring.rank_metrics",
    "ExpertLoadCallback": "hf_dist_recipes.moe.expert_load",
    "ExpertLoadTracker": "hf_dist_recipes.moe.expert_load",
    "StragglerCallback": "hf_dist_recipes.monitoring.stragglers",
    "StragglerDetector": "hf_dist_recipes.monitoring.stragglers",
    "busy_ratios": "hf_dist_recipes.monitoring.stragglers",
    "SystemMetricsCallback": "hf_dist_recipes.monitoring.system_metrics",
    "RunIdentity": "hf_dist_recipes.monitoring.system_metrics",
    "launch_identity": "hf_dist_recipes.monitoring.system_metrics",
    "RankSummaryCallback": "hf_dist_recipes.monitoring.summary_callback",
    "read_rank_summaries": "hf_dist_recipes.logs.summary",
    "summarize_ranks": "hf_dist_recipes.logs.summary",
}

__all__ = list(_PUBLIC)

# Written by summary_callback, read by logs.summary: named here, where neither imports the other's code.
SUMMARY_DIRNAME = "rank_summaries"

__getattr__ = lazy_names(__name__, _PUBLIC)
