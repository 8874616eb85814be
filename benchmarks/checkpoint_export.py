"""Time and peak host memory of `RecipeTrainer.save_model` (in the job) and of `checkpoint export` (offline, one
process), against the model's size, per layout, on real CPU ranks.

    python benchmarks/checkpoint_export.py             # a few minutes on 2 cores; run from the repository root

Models (DeepSeek-V3-style, fp32): tiny-deepseek-v3 (191,584 parameters), demo-deepseek-v3 (1,012,224) and `wide`,
the demo shape widened so that a decoder layer (16 experts of 512) is large against Python's own footprint.
Layouts: zero3 (accelerate_configs/cpu_zero3_2proc.yaml, 2 ranks) and tp2_ep2 (cpu_zero3_tp2_ep2_4proc.yaml, 4 ranks).
Each job trains 1 step, then times save_model and writes a DeepSpeed checkpoint that the offline export reads.
Memory: peak during the operation minus the value just before it (a 5 ms sampler thread), for the writing rank
and the largest over all ranks; the offline export runs in a fresh process. Two measures: RSS, and anonymous
memory (RSS minus file-backed pages: the offline export memory-maps the checkpoint, and mapped pages it has read
count in RSS although the kernel can drop them). Shards of SHARD (16 MiB, below the `wide` layer) so that the
shard buffer does not hide the streaming. glibc's mmap threshold is fixed at 1 MiB in the measured processes, so
that freed layers leave RSS. Goal: peak extra <= 2 x the largest layer + a constant.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from hf_dist_recipes.core.launch import Launch, free_port, run_launch, run_process

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": ("tiny-deepseek-v3", {}),
    "demo": ("demo-deepseek-v3", {}),
    "wide": (
        "demo-deepseek-v3",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=512,
            n_routed_experts=16,
            num_hidden_layers=6,
            q_lora_rank=256,
            kv_lora_rank=128,
        ),
    ),
}
LAYOUTS = {"zero3": "cpu_zero3_2proc.yaml", "tp2_ep2": "cpu_zero3_tp2_ep2_4proc.yaml"}
SHARD = "16MB"


class PeakRSS:
    """Peak resident set size of process `pid` (default: this one) while the context is open, sampled every 5 ms."""

    def __init__(self, pid: int | None = None):
        import psutil

        self.proc = psutil.Process(pid)
        self.before = self.peak = self.anon_before = self.anon_peak = 0
        self._stop = threading.Event()

    def _sample(self):
        while not self._stop.is_set():
            try:
                self._read()
            except Exception:  # the process ended
                return
            time.sleep(0.005)

    def _read(self):
        info = self.proc.memory_info()
        self.peak = max(self.peak, info.rss)
        self.anon_peak = max(self.anon_peak, info.rss - info.shared)

    def __enter__(self):
        info = self.proc.memory_info()
        self.before = self.peak = info.rss
        self.anon_before = self.anon_peak = info.rss - info.shared
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def extra(self) -> dict:
        return {"rss": self.peak - self.before, "anon": self.anon_peak - self.anon_before}


def model_sizes(model_key: str) -> dict:
    """Bytes of the whole model and of its largest streaming group (a decoder layer), fp32, from the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes.checkpoint.gather import group_key
    from hf_dist_recipes.core.model_templates import template_config

    name, overrides = MODELS[model_key]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(template_config(name, **overrides))
    groups: dict[str, int] = {}
    for n, t in model.state_dict().items():
        groups[group_key(n)] = groups.get(group_key(n), 0) + t.numel() * 4
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "model_bytes": sum(groups.values()),
        "largest_group_bytes": max(groups.values()),
    }


def trained_one_step(out: str, name: str, overrides: dict, micro_batch: int, shard: str = SHARD):
    """A RecipeTrainer (on this rank of the launch) that has trained one step of the template model `name` with
    `overrides` on stdlib text (sequence 32), nothing saved, no per-rank logs: the starting point of the save
    benchmarks (this file and checkpoint_writers.py)."""
    import warnings

    from transformers import AutoModelForCausalLM

    from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
    from hf_dist_recipes.core.model_templates import template_config
    from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

    warnings.filterwarnings("ignore")
    config = template_config(name, **overrides)
    args = RecipeTrainingArguments(
        output_dir=out,
        max_steps=1,
        per_device_train_batch_size=micro_batch,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        per_rank_tensorboard=False,
        save_shard_size=shard,
    )
    model = AutoModelForCausalLM.from_config(config)
    data = token_blocks(stdlib_dataset(seq_len=32, max_bytes=20_000), config.vocab_size)
    trainer = RecipeTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def worker(out: str, model_key: str) -> None:
    """Per rank: 1 training step, then save_model (timed, RSS sampled) and a DeepSpeed checkpoint."""
    import shutil

    import torch.distributed as dist

    name, overrides = MODELS[model_key]
    trainer = trained_one_step(out, name, overrides, micro_batch=2)
    dist.barrier()
    with PeakRSS() as mem:
        start = time.perf_counter()
        trainer.save_model(os.path.join(out, "final"))
        dist.barrier()
        seconds = time.perf_counter() - start
    ckpt = os.path.join(out, "ckpt")
    trainer.model_wrapped.save_checkpoint(ckpt)
    if dist.get_rank() == 0:
        shutil.copy(os.path.join(out, "final", "config.json"), ckpt)
    Path(out, f"save_rank{dist.get_rank()}.json").write_text(
        json.dumps({"rank": dist.get_rank(), "seconds": seconds, **mem.extra()})
    )


def offline(ckpt: str, out: str) -> None:
    """In a fresh process: imports first (deepspeed, which unpickling the checkpoint imports, and the model class:
    about 130 MiB, not counted), then the export, RSS sampled."""
    import deepspeed  # noqa: F401
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist_recipes.checkpoint.offline import export_checkpoint
    from hf_dist_recipes.core.sizes import parse_size

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))

    with PeakRSS() as mem:
        start = time.perf_counter()
        export_checkpoint(ckpt, out, max_shard_bytes=parse_size(SHARD))
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, **mem.extra()}))


def measure(model_key: str, layout: str, tmp: Path) -> dict:
    out = tmp / f"{model_key}-{layout}"
    # A fixed glibc mmap threshold: large freed tensors go back to the system at once, so RSS shows what is held,
    # not what glibc's growing heap kept after an earlier layer (measured without it: 50 to 115 MiB between runs).
    job = Launch.of(
        [__file__, "--worker", str(out), model_key],
        config_file=REPO / "accelerate_configs" / LAYOUTS[layout],
        main_port=free_port(),
        env={"MALLOC_MMAP_THRESHOLD_": "1048576"},
        cwd=REPO,
        timeout_s=1200,
    )
    proc = run_launch(job)
    if not proc.ok:
        raise RuntimeError(f"{model_key}/{layout} {proc.describe()}:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("save_rank*.json"))]
    off = run_process(
        [sys.executable, __file__, "--offline", str(out / "ckpt"), str(out / "exported")],
        env=job.child_env(),
        cwd=REPO,
        timeout_s=1200,
    )
    if not off.ok:
        raise RuntimeError(f"offline export of {model_key}/{layout} {off.describe()}:\n{off.stderr[-3000:]}")
    exported = json.loads(off.stdout.strip().splitlines()[-1])
    rank0 = next(r for r in ranks if r["rank"] == 0)
    return {
        "save_s": rank0["seconds"],
        "save_rank0": rank0["rss"],
        "save_max": max(r["rss"] for r in ranks),
        "export_s": exported["seconds"],
        "export_rss": exported["rss"],
        "export_anon": exported["anon"],
    }


def main() -> None:
    mib = 1024**2
    print(
        f"{'model':6} {'layout':8} {'params':>11} {'model MiB':>9} {'layer MiB':>9} | {'save s':>6} "
        f"{'rank0 +MiB':>10} {'max +MiB':>8} {'/layer':>6} | {'export s':>8} {'RSS +MiB':>8} {'anon +MiB':>9} "
        f"{'/layer':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for model_key in MODELS:
            sizes = model_sizes(model_key)
            layer = sizes["largest_group_bytes"]
            for layout in LAYOUTS:
                r = measure(model_key, layout, Path(tmp))
                print(
                    f"{model_key:6} {layout:8} {sizes['parameters']:>11,} {sizes['model_bytes'] / mib:>9.1f} "
                    f"{layer / mib:>9.2f} | {r['save_s']:>6.2f} {r['save_rank0'] / mib:>10.1f} "
                    f"{r['save_max'] / mib:>8.1f} {r['save_max'] / layer:>6.2f} | {r['export_s']:>8.2f} "
                    f"{r['export_rss'] / mib:>8.1f} {r['export_anon'] / mib:>9.1f} {r['export_anon'] / layer:>6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--offline"]:
        offline(sys.argv[2], sys.argv[3])
    else:
        main()
