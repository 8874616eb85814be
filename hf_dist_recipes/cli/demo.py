"""`hf-dist-recipes demo`: the main job. Trains the tiny DeepSeek-V3-style model with DeepSpeed ZeRO-3 on 2
processes (CPU + Gloo here; one process per GPU + NCCL on a CUDA host) and prints a summary.

The data is byte-level (no tokenizer): the standard library's source by default, or your own local text / JSON
Lines files with --data-files, read with datasets and cached by fingerprint (HF_DATASETS_CACHE); nothing is
downloaded."""

from __future__ import annotations

import argparse
import json

from hf_dist_recipes.demo.launch import DemoPlan, DemoResult, plan_demo, run_demo
from hf_dist_recipes.demo.settings import add_training_flags, settings_from


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a tiny DeepSeek-V3-style model with ZeRO-3 on 2 processes and summarise it",
        description=__doc__,
        epilog="Example: hf-dist-recipes demo --max-steps 100 --output runs/try1\n"
        "Your data: hf-dist-recipes demo --data-files notes.txt more.txt   (or: --data-files chat.jsonl "
        "--text-field content)\n"
        "Then: tensorboard --logdir runs/try1/tensorboard   (one run per rank)",
    )
    parser.add_argument(
        "--config-file", help="accelerate YAML to launch with (default: the shipped demo config for this host)"
    )
    parser.add_argument("--num-processes", type=int, help="override the config's num_processes")
    parser.add_argument("--dry-run", action="store_true", help="check the launch and print the plan, train nothing")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (ranks' output is hidden)")
    add_training_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_demo(settings_from(args), config_file=args.config_file, num_processes=args.num_processes)
    if args.dry_run:
        print(json.dumps(plan.as_dict(), indent=2) if args.json else render_plan(plan))
        return 0
    if not args.json:
        print(render_plan(plan), flush=True)
    result = run_demo(plan, quiet=args.json)
    print(json.dumps(result.as_dict(), indent=2) if args.json else render_result(result))
    return 0 if result.returncode == 0 else 1


def render_plan(plan: DemoPlan) -> str:
    return (
        f"demo: {plan.num_processes} processes, DeepSpeed ZeRO-3, {plan.device}/{plan.backend}, "
        f"{plan.settings.max_steps} steps\n"
        f"  config  {plan.config_file}\n"
        f"  data    {render_data(plan)}\n"
        f"  launch  {' '.join(plan.command[1:])}"
    )


def render_data(plan: DemoPlan) -> str:
    s = plan.settings
    if not s.data_files:
        return f"standard library source, {s.max_bytes:,} bytes, blocks of {s.seq_len}"
    return f"{' '.join(s.data_files)} (blocks of {s.seq_len} bytes)"


def render_result(result: DemoResult) -> str:
    if result.returncode != 0 or result.summary is None:
        return f"demo FAILED (exit {result.returncode}) after {result.wall_seconds:.1f} s; the ranks' output is above"
    s = result.summary
    drop = (1 - s.last_loss / s.first_loss) * 100 if s.first_loss else 0.0
    ranks = ", ".join(f"rank{r} {t:.1f} s" for r, t in sorted(s.train_seconds_by_rank.items()))
    lines = [
        f"demo finished in {result.wall_seconds:.1f} s (wall: launch, op build on a first run, training, saving)",
        f"  steps        {s.steps} on {s.ranks} ranks",
        f"  loss         {s.first_loss:.3f} -> {s.last_loss:.3f} "
        f"({'down' if result.loss_fell else 'NOT down'} {drop:.0f}%)",
        f"  tokens/s     {s.tokens_per_s:,.0f} (all ranks)",
        f"  train time   {ranks}",
        f"  seeds        {'same RNG state on every rank' if s.seeds_agree else 'RNG states DIFFER between ranks'}",
        f"  TensorBoard  tensorboard --logdir {s.logging_dir}",
    ]
    if result.plan.settings.save_final:
        lines.append(f"  model        {result.plan.settings.output_dir}/final")
    return "\n".join(lines)
