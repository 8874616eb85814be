"""How uneven the demo model's routing gets, with and without the default bias balancer, as our own `experts/*`
metrics see it: the measurement behind the memory estimate's routing-imbalance factor (issue 32, section 2).

    python benchmarks/expert_imbalance.py            # from the repository root; 4 CPU-minutes in all (14 min wall
                                                     # on a shared 2-core machine at load 15)
    python benchmarks/expert_imbalance.py --steps 50 # shorter
    python benchmarks/expert_imbalance.py --output DIR --reuse   # the summary again, from DIR's finished runs

Two runs, one after the other, the same in all but the balancer: the demo's model (`demo-deepseek-v3`, 8 routed
experts, top 2, MoE in decoder layers 1-3), data (the standard library's source, byte-level) and settings (sequence
128, micro batch 8, learning rate 3e-3, 20 warm-up steps, seed 42), on 2 CPU ranks under ZeRO-3 + DeepSpeed AutoEP
with EP 2 (a config written by `hf-dist-recipes config generate --cpu --model demo-deepseek-v3 --ep 2`), logging
every step:
  balanced   RecipeTrainingArguments defaults: `expert_bias_balancing=True` adds `ExpertBiasBalancer()` (gamma 0.001)
  frozen     `expert_bias_balancing=False`: the correction bias stays 0, as transformers trains it

Read from rank 0's `log_history` (the numbers are summed over both ranks, so every rank logs the same), per step:
`experts/max_over_mean` (the worst MoE layer's busiest expert over its mean expert load) and
`experts/ep_max_over_mean` (the worst layer's busiest EP rank over the mean EP rank; with EP = world size that is
exactly what each EP rank receives through the all-to-all). Printed per run: their mean over all steps, over the last
quarter, and the worst step; the final loss; how far the balancer moved the bias. The last line is the JSON of it all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hf_dist_recipes.core.launch import Launch, free_port, run_launch

REPO = Path(__file__).resolve().parents[1]
MODEL = "demo-deepseek-v3"
EP = 2
RUNS = {"balanced": True, "frozen": False}  # name -> expert_bias_balancing
KEYS = {"per_expert": "experts/max_over_mean", "per_ep_rank": "experts/ep_max_over_mean"}


def worker(out: str, steps: int, balancing: bool) -> None:
    """Per rank: the demo's training with `expert_bias_balancing=balancing`, a log every step; rank 0 writes its
    log history and the routers' final correction bias to OUT/history.json."""
    import warnings

    import torch

    from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
    from hf_dist_recipes.demo.data import stdlib_dataset
    from hf_dist_recipes.demo.model import build_tiny_deepseek
    from hf_dist_recipes.demo.settings import DemoSettings
    from hf_dist_recipes.moe.expert_load import find_routed_layers

    warnings.filterwarnings("ignore", category=FutureWarning)
    s = DemoSettings()
    args = RecipeTrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=s.micro_batch,
        learning_rate=s.learning_rate,
        warmup_steps=min(s.warmup_steps, steps - 1),
        logging_steps=1,
        seed=s.seed,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
        expert_bias_balancing=balancing,
    )
    with args.main_process_first(desc="byte blocks"):
        data = stdlib_dataset(seq_len=s.seq_len, max_bytes=s.max_bytes)
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(), args=args, train_dataset=data)
    trainer.train()
    if args.process_index == 0:
        bias = [layer.bias.detach().float().cpu() for layer in find_routed_layers(trainer.model)]
        record = {
            "history": trainer.state.log_history,
            "bias_spread": max((b.max() - b.min()).item() for b in bias),
            "ep_sizes": [layer.ep_size for layer in find_routed_layers(trainer.model)],
            "world_size": args.world_size,
            "torch": torch.__version__,
        }
        Path(out, "history.json").write_text(json.dumps(record))


def summarize(values: list[float]) -> dict[str, float]:
    """Per-step values (step 1 first): their mean, the mean over the last quarter, the worst step (1-based) and its
    value, and the worst step of the second half (after the start, where a fresh model's routing is settling)."""
    tail = values[-max(1, len(values) // 4) :]
    worst = max(range(len(values)), key=values.__getitem__)
    return {
        "mean": statistics.fmean(values),
        "last_quarter_mean": statistics.fmean(tail),
        "worst": values[worst],
        "worst_step": worst + 1,
        "second_half_worst": max(values[len(values) // 2 :]),
    }


def measure(config: Path, out: Path, steps: int, balancing: bool, reuse: bool = False) -> dict:
    """One run's summary; `reuse`: read a finished run's OUT/history.json instead of training again."""
    seconds = None
    if not (reuse and (out / "history.json").exists()):
        launch = Launch.of(
            [__file__, "--worker", str(out), str(steps), str(int(balancing))],
            config_file=config,
            main_port=free_port(),
            cwd=REPO,
        )
        proc = run_launch(launch)
        if not proc.ok:
            raise SystemExit(f"expert_bias_balancing={balancing}: {proc.describe()}:\n{proc.stderr[-3000:]}")
        seconds = round(proc.seconds, 1)
    record = json.loads((out / "history.json").read_text())
    steps_logged = [h for h in record["history"] if KEYS["per_expert"] in h]
    if len(steps_logged) != steps:
        raise SystemExit(f"expected {steps} logged steps with {KEYS['per_expert']}, found {len(steps_logged)}")
    losses = [h["loss"] for h in record["history"] if "loss" in h]
    layers = sorted(
        {k.split("/")[1] for h in steps_logged for k in h if k.endswith("/max_over_mean")} - {"max_over_mean"}
    )
    return {
        "expert_bias_balancing": balancing,
        "steps": steps,
        "seconds": seconds,
        "ep_sizes": record["ep_sizes"],
        "world_size": record["world_size"],
        "bias_spread": record["bias_spread"],
        "loss_first": losses[0],
        "loss_last_10": statistics.fmean(losses[-10:]),
        **{name: summarize([h[key] for h in steps_logged]) for name, key in KEYS.items()},
        "per_layer": {
            layer: {
                "per_expert": summarize([h[f"experts/{layer}/max_over_mean"] for h in steps_logged]),
                "per_ep_rank": summarize([h[f"experts/{layer}/ep_max_over_mean"] for h in steps_logged]),
            }
            for layer in layers
        },
    }


def main(argv: list[str] | None = None) -> None:
    from hf_dist_recipes.cli.main import main as cli_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (%(default)s, the demo's)")
    parser.add_argument("--output", type=Path, default=None, help="working folder (default: a new temporary one)")
    parser.add_argument(
        "--reuse", action="store_true", help="summarize the runs already in --output instead of training them again"
    )
    a = parser.parse_args(argv)
    root = a.output or Path(tempfile.mkdtemp(prefix="expert-imbalance-"))
    generated = ["config", "generate", "--cpu", "--model", MODEL, "--gpus-per-node", "2", "--zero", "3"]
    if cli_main([*generated, "--ep", str(EP), "--auto", "--name", "ep2", "--output", str(root / "cfg")]) != 0:
        raise SystemExit("config generate failed")
    config = root / "cfg" / "ep2.yaml"
    results = {name: measure(config, root / name, a.steps, on, a.reuse) for name, on in RUNS.items()}
    print(f"\n{MODEL}, {a.steps} steps, 2 ranks, ZeRO-3 + AutoEP EP {EP}; max/mean load, worst MoE layer per step")
    print(
        f"{'run':9} {'metric':12} {'mean':>6} {'last 1/4':>8} {'worst':>6} {'at step':>7} {'worst 2nd half':>14}"
        "   loss (last 10), bias spread"
    )
    for name, r in results.items():
        for metric in KEYS:
            m = r[metric]
            print(
                f"{name:9} {metric:12} {m['mean']:6.3f} {m['last_quarter_mean']:8.3f} {m['worst']:6.3f} "
                f"{m['worst_step']:7d} {m['second_half_worst']:14.3f}   {r['loss_last_10']:.3f}, {r['bias_spread']:.4f}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
    else:
        main()
