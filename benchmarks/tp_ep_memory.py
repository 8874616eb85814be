"""Per-rank model-state elements of the tiny DeepSeek-V3 (191,568 parameters) under three layouts, measured on
real CPU ranks, against the ideal total / ranks and against hf_dist_recipes' estimate.

    python benchmarks/tp_ep_memory.py            # about a minute on 2 cores; run from the repository root

Layouts, each trained 2 steps with RecipeTrainer through accelerate launch, with the model built two ways:
`from_config` (inside deepspeed.zero.Init, as from_pretrained does) and `direct` (the model class called itself):
  zero3        accelerate_configs/cpu_zero3_2proc.yaml            2 ranks, ZeRO-3 alone
  tp2_ep2      accelerate_configs/cpu_zero3_tp2_ep2_4proc.yaml    4 ranks, generated ZeRO-3 + TP 2 + EP 2
  preset_v2    stock AutoTP 2 with preset_model deepseek_v2        2 ranks (what the stock preset gives)
Measured: the sum over parameters of each rank's ZeRO partition (`ds_tensor.numel()`), largest over ranks.
Goal for tp2_ep2: measured / (total / ranks) <= 1.10, and the estimate equal to the measurement.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "distributed" / "workers" / "probe_worker.py"
MODEL = "tiny-deepseek-v3"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config: Path, out: Path, build: str) -> list[int]:
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(_port()),
        str(WORKER),
        str(out),
        "2",
        "recipe",
        MODEL,
        build,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{config.name} failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted((out / "probe").glob("rank*.json"))]
    return [sum(v["local"] for v in r["params"].values()) for r in ranks]


def main() -> None:
    from hf_dist_recipes.parallel.memory import rank_elements
    from hf_dist_recipes.parallel.models import introspect
    from hf_dist_recipes.parallel.plan import ParallelPlan

    model = introspect(MODEL)
    tmp = Path(tempfile.mkdtemp(prefix="tp-ep-memory-"))
    preset_json = tmp / "preset_v2.json"
    preset_json.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "tensor_parallel": {"autotp_size": 2, "preset_model": "deepseek_v2"},
            }
        )
    )
    preset_yaml = tmp / "preset_v2.yaml"
    preset_yaml.write_text(
        (REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml")
        .read_text()
        .replace("accelerate_configs/deepspeed/cpu_zero3_2proc.json", str(preset_json))
    )
    layouts = [
        (
            "zero3",
            REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml",
            ParallelPlan(procs_per_node=2, device="cpu", precision="fp32"),
        ),
        (
            "tp2_ep2",
            REPO / "accelerate_configs" / "cpu_zero3_tp2_ep2_4proc.yaml",
            ParallelPlan(procs_per_node=4, device="cpu", precision="fp32", tp=2, ep=2),
        ),
        ("preset_v2", preset_yaml, None),
    ]
    rows = []
    for build in ("from_config", "direct"):
        for name, config, plan in layouts:
            measured = measure(config, tmp / f"{name}-{build}", build)
            ideal = model.total_params / len(measured)
            estimate = rank_elements(replace(plan, zero_init=build == "from_config"), model).params if plan else None
            rows.append(
                {
                    "layout": name,
                    "build": build,
                    "ranks": len(measured),
                    "measured_per_rank": max(measured),
                    "ratio_to_ideal": round(max(measured) / ideal, 3),
                    "estimate": estimate,
                    "estimate_exact": estimate == max(measured) if estimate else None,
                }
            )
    print(f"{'layout':10} {'build':12} {'ranks':>5} {'per rank':>9} {'/ ideal':>8} {'estimate':>9} exact?")
    for r in rows:
        print(
            f"{r['layout']:10} {r['build']:12} {r['ranks']:>5} {r['measured_per_rank']:>9,} "
            f"{r['ratio_to_ideal']:>8.3f} {r['estimate'] or '-':>9} "
            f"{r['estimate_exact'] if r['estimate_exact'] is not None else '-'}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
