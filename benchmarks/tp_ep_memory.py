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
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from hf_dist_recipes.core.launch import Launch, free_port, run_launch

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-deepseek-v3"
STEPS = 2


def worker(out: str, build: str) -> None:
    """Per rank: train MODEL STEPS steps with RecipeTrainer (micro batch 4, sequences of 32 bytes), then write the
    elements of this rank's ZeRO partition of every parameter (`ds_tensor`) to OUT/rank<N>.json. `build`:
    `from_config` (inside deepspeed.zero.Init under ZeRO-3) or `direct` (the model class called itself)."""
    import warnings

    from transformers import AutoModelForCausalLM

    from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
    from hf_dist_recipes.core.model_templates import template_config
    from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    config = template_config(MODEL)
    if build == "direct":
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        model_init = lambda: model_class(config)  # noqa: E731
    else:
        model_init = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    data = token_blocks(stdlib_dataset(seq_len=32, max_bytes=200_000), config.vocab_size)
    trainer = RecipeTrainer(model_init=model_init, args=args, train_dataset=data)
    trainer.train()
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in trainer.model.parameters())
    Path(out, f"rank{args.process_index}.json").write_text(json.dumps({"rank": args.process_index, "local": local}))


def measure(config: Path, out: Path, build: str) -> list[int]:
    launch = Launch.of([__file__, "--worker", str(out), build], config_file=config, main_port=free_port(), cwd=REPO)
    proc = run_launch(launch)
    if not proc.ok:
        raise SystemExit(f"{config.name} {proc.describe()}:\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text())["local"] for p in sorted(out.glob("rank*.json"))]


def main() -> None:
    from hf_dist_recipes.planning.memory import rank_elements
    from hf_dist_recipes.planning.models import introspect
    from hf_dist_recipes.planning.plan import ParallelPlan

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
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
