"""Run on every rank by tests/distributed/test_preflight_training.py under `accelerate launch`.

    preflight_training_worker.py OUTPUT_DIR [--model TEMPLATE] [--steps N] [--seed S]

Calls `hf_dist_recipes.preflight.training.run_training_checks` with the template's config (default tiny-deepseek-v3)
and writes what this rank returned to OUTPUT_DIR/preflight/rank<N>.json: the results as dicts, the progress lines
(prefixed with the seconds since the start) and the seconds the checks took.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.preflight.training import run_training_checks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("--model", default="tiny-deepseek-v3")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=None)
    opts = p.parse_args()
    lines: list[str] = []
    start = time.perf_counter()
    results = run_training_checks(
        template_config(opts.model),
        steps=opts.steps,
        output_dir=opts.output_dir,
        seed=opts.seed,
        on_progress=lambda line: lines.append(f"{time.perf_counter() - start:.1f}s {line}"),
    )
    elapsed = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    target = Path(opts.output_dir) / "preflight"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "results": [r.to_dict() for r in results], "progress": lines, "elapsed_s": elapsed})
    )


if __name__ == "__main__":
    main()
