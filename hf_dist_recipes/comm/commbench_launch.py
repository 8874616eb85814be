"""Launch `hf_dist_recipes.comm.commbench` on N local processes (torchrun, a free port), read back rank 0's JSON, put a
Gloo run side by side with NCCL (`hf_dist_recipes.comm.commbench_render` renders the results as a table)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

from hf_dist_recipes.comm import backend as backends
from hf_dist_recipes.comm.commbench import BenchSettings, check_settings, settings_args
from hf_dist_recipes.core.launch import Launch, run_launch
from hf_dist_recipes.core.user_values import positive_int


@dataclass(frozen=True)
class CommbenchPlan:
    """Checked launch: `backends` is ("nccl",), ("gloo",) or ("nccl", "gloo") for the side-by-side on a GPU host."""

    num_processes: int
    backends: tuple[str, ...]
    settings: BenchSettings


def plan_commbench(
    settings: BenchSettings,
    *,
    num_processes: int | None = None,
    backend: str | None = None,
    cuda_devices: int | None = None,
) -> CommbenchPlan:
    """Processes default to one per visible GPU, else 2. `backend` "gloo" on a GPU host means Gloo next to NCCL;
    NCCL without a GPU is ValueError (backend.resolve_backend's message)."""
    gpus = backends.cuda_device_count() if cuda_devices is None else cuda_devices
    n = num_processes if num_processes is not None else (gpus if gpus >= 2 else 2)
    positive_int(n, "--num-processes", 2, minimum=2, unit="processes")
    if gpus and n > gpus:
        fix = (
            f"e.g. --num-processes {gpus}"
            if gpus >= 2
            else "one GPU has no GPU-to-GPU link to measure; "
            "`CUDA_VISIBLE_DEVICES= hf-dist-recipes commbench` measures Gloo between CPU processes"
        )
        raise ValueError(f"--num-processes {n} needs {n} GPUs (one per NCCL rank), {gpus} visible; {fix}")
    check_settings(settings)
    if backend == backends.GPU_BACKEND and not gpus:
        raise ValueError(
            "--backend nccl needs CUDA GPUs and this host has none visible (torch.cuda.is_available() "
            "is False); leave out --backend to measure Gloo here, or check CUDA_VISIBLE_DEVICES"
        )
    if backend == backends.CPU_BACKEND and gpus:
        chosen = (backends.GPU_BACKEND, backends.CPU_BACKEND)
    else:
        chosen = (backends.resolve_backend(backend, cuda_devices=gpus),)
    return CommbenchPlan(num_processes=n, backends=chosen, settings=settings)


def worker_launch(plan: CommbenchPlan, backend: str, output: str) -> Launch:
    """The torchrun launch of the ranks measuring `backend` (on 127.0.0.1, a free port), rank 0 writing `output`."""
    args = ["--backend", backend, "--output", output, *settings_args(plan.settings)]
    if backend == backends.CPU_BACKEND and backends.GPU_BACKEND in plan.backends:
        args.append("--allow-gloo-on-cuda")  # asked for explicitly: the side-by-side with NCCL
    return Launch(
        module="hf_dist_recipes.comm.commbench",
        args=tuple(args),
        launcher="torchrun",
        num_processes=plan.num_processes,
        main_address="127.0.0.1",
        env_defaults={"OMP_NUM_THREADS": "1"},  # torchrun's own default, set here so it does not warn about it
    )


def run_commbench(plan: CommbenchPlan) -> dict:
    """Launch each backend of `plan` in turn; {"backend": ..., results...} for one, side_by_side() for two.
    A failed launch is RuntimeError with its exit status (the ranks' output is already on stderr)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="commbench-") as tmp:
        for name in plan.backends:
            out = os.path.join(tmp, f"{name}.json")
            # Ranks write nothing to stdout with --output; their progress and errors go to stderr.
            launched = run_launch(worker_launch(plan, name, out), output="to_stderr")
            if launched.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(
                    f"commbench on {name} failed (exit {launched.returncode}); the ranks' output is above"
                )
            with open(out, encoding="utf-8") as f:
                runs.append(json.load(f))
    return runs[0] if len(runs) == 1 else side_by_side(*runs)


def side_by_side(nccl: dict, gloo: dict) -> dict:
    """Both runs and, per op and size measured by both, the times and how many times slower Gloo is."""
    theirs = {(r["op"], r["size_bytes"]): r for r in gloo["results"]}
    rows = []
    for r in nccl["results"]:
        g = theirs.get((r["op"], r["size_bytes"]))
        if g is None or r["time_us"] is None or g["time_us"] is None:
            continue
        rows.append(
            {
                "op": r["op"],
                "size_bytes": r["size_bytes"],
                "nccl_time_us": r["time_us"],
                "gloo_time_us": g["time_us"],
                "gloo_slower_x": g["time_us"] / r["time_us"],
            }
        )
    return {"side_by_side": True, "world_size": nccl["world_size"], "runs": [nccl, gloo], "comparison": rows}
