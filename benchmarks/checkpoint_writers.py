"""Export time with 1, 2 and 4 writers: `checkpoint export --workers N` (offline) and `save_model` in the job (every
rank writes its share) against the single writer, with the files compared by sha256.

    python benchmarks/checkpoint_writers.py             # 10-25 minutes on 2 busy cores; run from the repository root
    BENCH_DIR=/some/dir python benchmarks/checkpoint_writers.py    # keep the job there; a second run reuses it

The model: the demo's DeepSeek-V3 shape widened to 219.7M parameters (hidden 768, 8 layers, 16 routed experts of
768), fp32, 879 MB of weights; shards of SHARD (64 MB, 14 files) so that every writer has files to write (DeepSeek-V3
in 5 GB shards has 269). One job on 2 ranks (accelerate_configs/cpu_zero3_2proc.yaml) trains 1 step, then times
save_model with shared writing and the single writer (rank 0 writes every file, the behaviour before), twice each in
turn, and writes a DeepSpeed checkpoint. The offline export of that checkpoint then runs with --workers 1, 2 and 4,
twice over: with torch's default threads (the 1-writer export copies with every core) and with OMP_NUM_THREADS=1
(one thread per process, as torchrun and accelerate set for each rank); each time
REPEATS times each in turn (fresh output folder each time); the table gives medians of the wall time, the CPU time
of all the export's processes, and the critical path in CPU time (the parent's own work + the busiest writer
process: the wall time where each writer has a free core), each as a ratio to 1 writer. On a machine whose cores
other jobs keep busy, the wall time cannot fall with more processes; the critical path shows the division of the
work. Every output is hashed and compared with the single writer's.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_export import trained_one_step  # benchmarks/ is on sys.path when a benchmark runs as a script

from hf_dist_recipes.core.launch import Launch, free_port, run_launch, run_process

REPO = Path(__file__).resolve().parents[1]

MODEL = dict(
    hidden_size=768,
    intermediate_size=1536,
    moe_intermediate_size=768,
    n_routed_experts=16,
    num_hidden_layers=8,
    q_lora_rank=384,
    kv_lora_rank=192,
)
SHARD = "64MB"
REPEATS = 5
WRITERS = (1, 2, 4)


def hashes(folder: str | Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).iterdir())
        if p.suffix == ".safetensors" or p.name == "model.safetensors.index.json"
    }


def worker(out: str) -> None:
    """Per rank: 1 training step, save_model (shared) and the single writer, twice each, then a DeepSpeed
    checkpoint."""
    import torch.distributed as dist

    from hf_dist_recipes.checkpoint.export import save_hf_checkpoint

    trainer = trained_one_step(out, "demo-deepseek-v3", MODEL, micro_batch=1, shard=SHARD)
    args = trainer.args
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    seconds: dict[str, list[float]] = {"shared": [], "single": []}
    for _ in range(2):
        for kind in ("shared", "single"):
            dist.barrier()
            start = time.perf_counter()
            save_hf_checkpoint(
                unwrapped,
                os.path.join(out, kind),
                max_shard_bytes=args.save_shard_bytes,
                shared=kind == "shared",
            )
            dist.barrier()
            seconds[kind].append(time.perf_counter() - start)
    ckpt = os.path.join(out, "ckpt")
    trainer.model_wrapped.save_checkpoint(ckpt)
    if dist.get_rank() == 0:
        shutil.copy(os.path.join(out, "shared", "config.json"), ckpt)
        Path(out, "save_seconds.json").write_text(json.dumps(seconds))


def offline(ckpt: str, out: str, workers: int) -> None:
    """In a fresh process, imports first (not timed: deepspeed, the model class, transformers' weight conversions,
    about 3 s here and the same for any model size), then the export."""
    import deepspeed  # noqa: F401
    import torch
    import transformers.core_model_loading  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist_recipes.checkpoint.offline import export_checkpoint
    from hf_dist_recipes.core.sizes import parse_size

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))

    def cpu(who) -> float:  # user + system seconds
        u = resource.getrusage(who)
        return u.ru_utime + u.ru_stime

    start, own, children = time.perf_counter(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    result = export_checkpoint(ckpt, out, max_shard_bytes=parse_size(SHARD), workers=workers)
    seconds, own = time.perf_counter() - start, cpu(resource.RUSAGE_SELF) - own
    children = cpu(resource.RUSAGE_CHILDREN) - children
    # The critical path: this process's own work (loading, the plan, the index) + the busiest writer process.
    critical = own + max(result.writer_cpu_seconds.values(), default=0.0)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": own + children,
                "critical_cpu_seconds": critical,
                "bytes": result.bytes,
                "files": len(result.files),
            }
        )
    )


def main() -> None:
    keep = os.environ.get("BENCH_DIR")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        job = Path(tmp) / "job"
        launch = Launch.of(
            [__file__, "--worker", str(job)],
            config_file=REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml",
            main_port=free_port(),
            cwd=REPO,
            timeout_s=1800,
        )
        env = launch.child_env()
        if not (job / "save_seconds.json").is_file():
            proc = run_launch(launch)
            if not proc.ok:
                raise RuntimeError(f"the job {proc.describe()}:\n{proc.stderr[-3000:]}")
        save = json.loads((job / "save_seconds.json").read_text())
        reference = hashes(job / "single")
        assert hashes(job / "shared") == reference, "save_model's shared files differ from the single writer's"
        print("save_model in the job, 2 ranks (seconds, two runs each, in turn):")
        print(f"  single writer (rank 0) {save['single']}  shared (both ranks) {save['shared']}")
        print(
            f"  ratio single/shared (best of each): {min(save['single']) / min(save['shared']):.2f}; files "
            "identical by sha256"
        )
        # torch's default (every core for each process's copies), then one thread per process (what torchrun and
        # accelerate set for each rank: OMP_NUM_THREADS=1), where each writer needs a core of its own.
        for threads in (None, "1"):
            export_table(job, Path(tmp), dict(env, OMP_NUM_THREADS=threads) if threads else env, threads)
        print(f"files in {tmp}; load average (1 min) at the end: {os.getloadavg()[0]:.1f}; cores: {os.cpu_count()}")


def export_table(job: Path, tmp: Path, env: dict, threads: str | None) -> None:
    times: dict[int, list[float]] = {w: [] for w in WRITERS}
    cpu: dict[int, list[float]] = {w: [] for w in WRITERS}
    critical: dict[int, list[float]] = {w: [] for w in WRITERS}
    size = files = 0
    reference = None
    for _ in range(REPEATS):
        for w in WRITERS:
            out = tmp / f"export{w}"
            shutil.rmtree(out, ignore_errors=True)
            run = run_process(
                [sys.executable, __file__, "--offline", str(job / "ckpt"), str(out), str(w)],
                env=env,
                cwd=REPO,
                timeout_s=1800,
            )
            if not run.ok:
                raise RuntimeError(f"export with {w} writers {run.describe()}:\n{run.stderr[-3000:]}")
            r = json.loads(run.stdout.strip().splitlines()[-1])
            times[w].append(r["seconds"])
            cpu[w].append(r["cpu_seconds"])
            critical[w].append(r["critical_cpu_seconds"])
            size, files = r["bytes"], r["files"]
            digest = hashes(out)
            reference = reference or digest
            assert digest == reference, f"{w} writers wrote other bytes than 1 writer"
            shutil.rmtree(out)  # hashed: room for the next (BENCH_DIR may be a tmpfs)
    print(
        f"checkpoint export of {size / 1e6:,.0f} MB (fp32) in {files} files of <= {SHARD}, {REPEATS} runs per writer "
        f"count in turn, threads per process: {threads or 'torch default'} (seconds):"
    )
    base, base_min, base_path = statistics.median(times[1]), min(times[1]), statistics.median(critical[1])
    print(
        f"{'writers':>7} {'wall s':>7} {'ratio':>6} {'min s':>6} {'ratio':>6} {'CPU s':>6} {'critical CPU s':>14} "
        f"{'ratio':>6}   wall runs"
    )
    for w in WRITERS:
        runs = ", ".join(f"{t:.2f}" for t in times[w])
        wall, path = statistics.median(times[w]), statistics.median(critical[w])
        print(
            f"{w:>7} {wall:>7.2f} {base / wall:>6.2f} {min(times[w]):>6.2f} {base_min / min(times[w]):>6.2f} "
            f"{statistics.median(cpu[w]):>6.2f} {path:>14.2f} {base_path / path:>6.2f}   {runs}"
        )
    print(
        "ratio: 1 writer's / this one's; wall and CPU medians, min: the least disturbed run; critical CPU: the "
        "parent's own CPU time + the busiest writer process's (the wall time where every writer has a free core); "
        "every export's files identical by sha256 to the first 1-writer export"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    elif sys.argv[1:2] == ["--offline"]:
        offline(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
