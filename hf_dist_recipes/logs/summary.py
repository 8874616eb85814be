"""Per-rank run summaries (written by `summary_callback.RankSummaryCallback`): read them back and fold them into one.

No transformers import here, so the CLI can read a finished run cheaply.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_dist_recipes.monitoring import SUMMARY_DIRNAME


def read_rank_summaries(output_dir: str | os.PathLike) -> list[dict]:
    """The per-rank summaries of a finished run, ordered by rank (empty if none were written)."""
    folder = Path(output_dir) / SUMMARY_DIRNAME
    rows = [json.loads(p.read_text()) for p in folder.glob("rank*.json")]
    return sorted(rows, key=lambda row: row["rank"])


@dataclass(frozen=True)
class RunSummary:
    """One run across ranks. `tokens`: summed over ranks (under tensor parallelism the ranks of one TP group count
    the same samples); `tokens_per_s`: those tokens over the slowest rank's train time."""

    ranks: int
    steps: int
    first_loss: float | None
    last_loss: float | None
    tokens: int
    tokens_per_s: float | None
    train_seconds_by_rank: dict[int, float]
    seeds_agree: bool
    logging_dir: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def summarize_ranks(rows: list[dict]) -> RunSummary:
    """Fold per-rank summaries (from `read_rank_summaries`) into one `RunSummary`."""
    if not rows:
        raise ValueError("no per-rank summaries found; did training finish? (look for rank_summaries/ in output_dir)")
    slowest = max(row["train_seconds"] for row in rows)
    tokens = sum(row["tokens"] for row in rows)
    return RunSummary(
        ranks=len(rows),
        steps=rows[0]["steps"],
        first_loss=rows[0]["first_loss"],
        last_loss=rows[0]["last_loss"],
        tokens=tokens,
        tokens_per_s=tokens / slowest if slowest else None,
        train_seconds_by_rank={row["rank"]: row["train_seconds"] for row in rows},
        seeds_agree=len({row["rng_fingerprint"] for row in rows}) == 1,
        logging_dir=rows[0]["logging_dir"],
    )
