"""Peak host memory of a resume under ZeRO-3 + optimizer offload, DeepSpeed's plain `torch.load` of each rank's
optimizer file (before) against the memory-mapped load (after: `memory_mapped_resume`, the default;
hf_dist_recipes/checkpoint/resume_loading.py), on 2 real CPU ranks, side by side in one run.

    PATH=.venv/bin:$PATH python benchmarks/resume_host_memory.py   # about 3.5 minutes on 2 busy cores; repo root
    BENCH_DIR=/some/disk/dir python benchmarks/resume_host_memory.py   # keep the files (not a tmpfs: see below)
    python benchmarks/resume_host_memory.py --report /some/disk/dir     # the tables again from the kept files

The model: the demo's DeepSeek-V3 shape widened to 43.3M parameters (hidden 512, 4 layers, 16 routed experts of
512), fp32. One 2-rank job (accelerate launch, Gloo, DeepSpeed ZeRO-3 with `offload_optimizer: cpu` and an AdamW
section, so that DeepSpeedCPUAdam steps the states in host memory as on a GPU node) trains 1 step and writes
checkpoint-1: per rank an optimizer file of 12 bytes per parameter of its partition (fp32 master + the two Adam
moments). Then the resume is launched REPEATS x 2 times, alternating stock and mapped (fresh processes each time,
so that one does not warm the other's allocator), each a RecipeTrainer that resumes from checkpoint-1 and trains
step 2. Run it with the environment's bin/ first on PATH, as the tests do (tests/conftest.py): another ninja than
theirs makes DeepSpeed rebuild cpu_adam, minutes on 2 busy cores.

Measured in each rank, around the engine's `load_checkpoint` (the call transformers' resume makes; with the mapped
load it includes copying the states out of the files):
- steady: /proc/self/status just before the load (the engine built, its offloaded states allocated);
- peak RSS: `VmHWM`, the kernel's high-water mark of RSS, reset (`echo 5 > /proc/self/clear_refs`) just before the
  load, so exact and for this window only (`ru_maxrss` cannot be reset: it would include start-up and training);
- peak RssAnon: the largest `RssAnon` a 2 ms sampler thread read in the window. Anonymous memory is the process's own
  (what the OOM killer and the node's memory budget count); a mapped file's pages count in RSS too (`RssFile`), but
  they are the page cache's: clean, shared, dropped by the kernel under pressure. Both are reported.
The node's figure is the sum over its ranks (every rank loads at the same moment). The files must be on a disk: on a
tmpfs (/dev/shm) mapped pages would be shared memory the kernel cannot drop.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from hf_dist_recipes.core.launch import Launch, free_port, run_launch

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=512,
    n_routed_experts=16,
    num_hidden_layers=4,
    q_lora_rank=256,
    kv_lora_rank=128,
)
REPEATS = 1  # the figures are bytes, not times: one launch of each shows them (a repeat costs 2 launches)
DEEPSPEED = {
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},  # no CUDA to pin with on CPU
        "stage3_gather_16bit_weights_on_model_save": False,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "steps_per_print": 1000000,
}
STATUS = re.compile(r"^(VmHWM|VmRSS|RssAnon|RssFile|RssShmem):\s+(\d+) kB$", re.M)


def status() -> dict[str, int]:
    """This process's memory figures from /proc/self/status, in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        return {name: int(kb) * 1024 for name, kb in STATUS.findall(f.read())}


class LoadWindow:
    """Memory of this process while the context is open: steady (at entry), the exact RSS high-water mark (VmHWM,
    reset at entry) and the sampled peaks of RssAnon and RssFile (every 2 ms)."""

    def __enter__(self):
        self.steady = status()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.peak_anon, self.peak_file = self.steady["RssAnon"], self.steady["RssFile"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.start = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.is_set():
            now = status()
            self.peak_anon = max(self.peak_anon, now["RssAnon"])
            self.peak_file = max(self.peak_file, now["RssFile"])
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self._stop.set()
        self._thread.join()
        self.after = status()
        self.peak_anon = max(self.peak_anon, self.after["RssAnon"])

    def record(self) -> dict:
        return {
            "steady": self.steady,
            "peak_rss": self.after["VmHWM"],
            "peak_anon": self.peak_anon,
            "peak_file": self.peak_file,
            "after": self.after,
            "seconds": self.seconds,
        }


def _arguments(out: str, steps: int, mapped: bool):
    from hf_dist_recipes import RecipeTrainingArguments

    return RecipeTrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=1,
        learning_rate=1e-3,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
        per_rank_tensorboard=False,
        memory_mapped_resume=mapped,
    )


def worker(out: str, mode: str) -> None:
    """One rank. `save`: train step 1, write out/save/checkpoint-1. `stock` / `mapped`: resume from it, train step 2,
    with the load measured; writes out/<mode>/rank<N>.json."""
    import warnings

    from transformers import AutoModelForCausalLM

    from hf_dist_recipes import RecipeTrainer
    from hf_dist_recipes.core.model_templates import template_config
    from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

    warnings.filterwarnings("ignore")
    saving = mode == "save"
    args = _arguments(os.path.join(out, mode), 1 if saving else 2, mapped=mode == "mapped")
    config = template_config("demo-deepseek-v3", **MODEL)
    model = AutoModelForCausalLM.from_config(config)
    data = token_blocks(stdlib_dataset(seq_len=32, max_bytes=20_000), config.vocab_size)
    windows: list[LoadWindow] = []

    class Measured(RecipeTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            scheduler = super().create_scheduler(num_training_steps, optimizer)  # installs the mapped load, if on
            wrapped = self.accelerator.deepspeed_engine_wrapped
            if wrapped is not None and not windows:
                engine, load = wrapped.engine, wrapped.engine.load_checkpoint

                def measured_load(*a, **k):
                    window = LoadWindow()
                    windows.append(window)
                    with window:
                        return load(*a, **k)

                engine.load_checkpoint = measured_load
            return scheduler

    trainer = Measured(model=model, args=args, train_dataset=data)
    resume = None if saving else os.path.join(out, "save", "checkpoint-1")
    trainer.train(resume_from_checkpoint=resume)
    if saving:
        return
    rank = args.process_index
    optim = [p for p in Path(resume).glob("global_step1/*optim_states.pt") if f"_rank_{rank}_" in p.name]
    loads = trainer.resume_loads
    record = {
        "rank": rank,
        "optim_file_bytes": optim[0].stat().st_size,
        "window": windows[0].record(),
        "end_of_training": status(),
        "loss": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "mapped_files": None if loads is None else [f.path for f in loads.files if f.mapped],
    }
    Path(out, mode, f"rank{rank}.json").write_text(json.dumps(record))


def launch(out: Path, mode: str, config: Path) -> list[dict]:
    run = run_launch(
        Launch.of(
            [__file__, "--worker", str(out), mode], config_file=config, main_port=free_port(), cwd=REPO, timeout_s=900
        )
    )
    if not run.ok:
        raise RuntimeError(f"the {mode} launch {run.describe()}:\n{run.stderr[-3000:]}")
    if mode == "save":
        return []
    return [json.loads(p.read_text()) for p in sorted((out / mode).glob("rank*.json"))]


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    keep = os.environ.get("BENCH_DIR")
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(keep or scratch)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ds.json").write_text(json.dumps(DEEPSPEED))
        yaml = (REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml").read_text()
        yaml = re.sub(r"deepspeed_config_file: .*", f"deepspeed_config_file: {out / 'ds.json'}", yaml)
        config = out / "offload.yaml"
        config.write_text(yaml)
        start = time.perf_counter()
        launch(out, "save", config)
        runs: dict[str, list[list[dict]]] = {"stock": [], "mapped": []}
        for _ in range(REPEATS):
            for mode in runs:
                runs[mode].append(launch(out, mode, config))
                (out / mode).rename(out / f"{mode}-{len(runs[mode])}")
        report(runs)
        print(
            f"wall {time.perf_counter() - start:.0f} s; files in {out}{'' if keep else ' (removed)'}; cores "
            f"{os.cpu_count()}; load average (1 min) at the end {os.getloadavg()[0]:.1f}"
        )


def saved_runs(out: Path) -> dict[str, list[list[dict]]]:
    """The rank records of a kept run (BENCH_DIR), as `main` collected them."""
    runs: dict[str, list[list[dict]]] = {}
    for mode in ("stock", "mapped"):
        folders = sorted(out.glob(f"{mode}-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
        runs[mode] = [[json.loads(p.read_text()) for p in sorted(f.glob("rank*.json"))] for f in folders]
    return runs


def report(runs: dict[str, list[list[dict]]]) -> None:
    first = runs["stock"][0]
    files = [r["optim_file_bytes"] for r in first]
    sizes = ", ".join(f"rank {r['rank']} {r['optim_file_bytes']:,} B" for r in first)
    print(f"per-rank optimizer file F: {sizes} ({mib(sum(files) / len(files))} MiB each)")
    print(
        "MiB per rank. before: /proc/self/status just before load_checkpoint; after: just after it returned (the "
        "Adam moments now exist: DeepSpeed 0.19.8 creates them at the first step, so before the load they do not); "
        "peak RSS: VmHWM over the load; peak anon: sampled RssAnon; over after: peak - after (what the load costs "
        "above the steady state)"
    )
    print(
        f"{'load':>7} {'run':>3} {'rank':>4} {'before anon':>11} {'after anon':>10} {'peak anon':>9} "
        f"{'over after':>10} {'before RSS':>10} {'after RSS':>9} {'peak RSS':>8} {'over after':>10} "
        f"{'peak file':>9} {'load s':>6}   step-2 loss"
    )
    for mode, repeats in runs.items():
        for i, ranks in enumerate(repeats, start=1):
            for r in ranks:
                w = r["window"]
                b, a = w["steady"], w["after"]
                print(
                    f"{mode:>7} {i:>3} {r['rank']:>4} {mib(b['RssAnon']):>11} {mib(a['RssAnon']):>10} "
                    f"{mib(w['peak_anon']):>9} {mib(w['peak_anon'] - a['RssAnon']):>10} {mib(b['VmRSS']):>10} "
                    f"{mib(a['VmRSS']):>9} {mib(w['peak_rss']):>8} {mib(w['peak_rss'] - a['VmRSS']):>10} "
                    f"{mib(w['peak_file']):>9} {w['seconds']:>6.2f}   {r['loss'][-1]:.6f}"
                )
    print("node (sum over the ranks), MiB:")
    for mode, repeats in runs.items():
        for i, ranks in enumerate(repeats, start=1):
            before = sum(r["window"]["steady"]["RssAnon"] for r in ranks)
            after = sum(r["window"]["after"]["RssAnon"] for r in ranks)
            anon = sum(r["window"]["peak_anon"] for r in ranks)
            rss = sum(r["window"]["peak_rss"] for r in ranks)
            print(
                f"  {mode:>6} run {i}: anon before {mib(before)}, after {mib(after)}, peak {mib(anon)} = after + "
                f"{mib(anon - after)} ({(anon - after) / sum(files):.2f} x P x F) = before + {mib(anon - before)} "
                f"({(anon - before) / sum(files):.2f} x P x F); peak RSS {mib(rss)}"
            )
    losses = {(r["rank"], tuple(r["loss"])) for repeats in runs.values() for ranks in repeats for r in ranks}
    print(f"each rank's step-2 loss identical in every run, stock and mapped: {len(losses) == len(first)}")
    mapped = [r["mapped_files"] for ranks in runs["mapped"] for r in ranks]
    print(f"mapped runs read their optimizer file memory-mapped: {all(any('optim' in p for p in m) for m in mapped)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--report"]:  # the tables again, from a kept run's folder (BENCH_DIR)
        report(saved_runs(Path(sys.argv[2])))
    else:
        main()
