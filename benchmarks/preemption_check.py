"""What the preemption agreement costs per step (`hf_dist_recipes.checkpoint.preemption`): one all-reduce of two
integers at every step end, so that ranks signalled at different moments save the same step.

    python benchmarks/preemption_check.py                 # 2 ranks, Gloo on CPU: about a minute
    python benchmarks/preemption_check.py --calls 5000 --steps 40

One `accelerate launch` of 2 ranks (accelerate_configs/cpu_zero3_2proc.yaml: ZeRO-3, Gloo) runs this file as its
worker. In the same processes: (1) `agree()` alone, `--calls` times, after a barrier: its mean time per call;
(2) a tiny Llama trained `--steps` steps with `preemption_signals="none"` and with the default, alternating
(off, on, off, on), each run's seconds per step from the Trainer's own `train_runtime`. Printed: the agreement's
microseconds per call and as a share of a step, and the ratio of the two settings' step times (the same run, side
by side; on 2 busy cores the ratio's noise is a few percent, far above the call's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rank_main(out: Path, calls: int, steps: int) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
    from hf_dist_recipes.checkpoint.preemption import DEFAULT_PREEMPTION_SIGNALS, agree
    from hf_dist_recipes.core.model_templates import template_config
    from hf_dist_recipes.demo.data import TokenBlocks, stdlib_dataset, token_blocks

    runs = []
    for index, signals in enumerate(["none", DEFAULT_PREEMPTION_SIGNALS] * 2):
        args = RecipeTrainingArguments(
            output_dir=str(out / f"run{index}"), max_steps=steps, per_device_train_batch_size=4, logging_steps=steps,
            save_strategy="no", report_to="none", disable_tqdm=True, preemption_signals=signals,
        )  # fmt: skip
        if index == 0:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                agree(None, args)
            agree_s = (time.perf_counter() - start) / calls
        model = AutoModelForCausalLM.from_config(template_config("tiny-llama"))
        blocks = token_blocks(stdlib_dataset(seq_len=64, max_bytes=80_000), model.config.vocab_size)
        trainer = RecipeTrainer(model=model, args=args, train_dataset=TokenBlocks(blocks.tokens))
        result = trainer.train()
        runs.append({"signals": signals, "s_per_step": result.metrics["train_runtime"] / steps})
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({"agree_s": agree_s, "runs": runs}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="agree() calls timed (default 2000)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--out", default="/tmp/preemption_check", help="the runs' output folder")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # a new launch refuses to mix its TensorBoard curves into an old run's
    out.mkdir(parents=True)
    config = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_DIST_RECIPES_USE_CPU="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), __file__, "--rank"]
    proc = subprocess.run([*cmd, str(out), str(args.calls), str(args.steps)], env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    result = json.loads((out / "result.json").read_text())
    off = [r["s_per_step"] for r in result["runs"] if r["signals"] == "none"]
    on = [r["s_per_step"] for r in result["runs"] if r["signals"] != "none"]
    step = sum(off) / len(off)
    print(f"agree(): {result['agree_s'] * 1e6:.1f} us per call over {args.calls} calls (2 ranks, Gloo, CPU)")
    print(f"step without the check: {step * 1e3:.1f} ms (runs {', '.join(f'{s * 1e3:.1f}' for s in off)})")
    print(f"step with the check:    {sum(on) / len(on) * 1e3:.1f} ms (runs {', '.join(f'{s * 1e3:.1f}' for s in on)})")
    print(f"the call as a share of a step: {result['agree_s'] / step:.3%}")
    print(f"ratio with/without (same launch, alternating): {sum(on) / len(on) / step:.3f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
