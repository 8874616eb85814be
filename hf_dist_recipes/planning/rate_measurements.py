"""Measure the step model's rates on this host (`hf-dist-recipes calibrate`): what `planning.calibration` writes into a
profile and `config estimate --profile` uses instead of the `--hardware` preset's assumptions.

- CPU Adam: DeepSpeed's `DeepSpeedCPUAdam` (deepspeed/ops/adam/cpu_adam.py, the optimizer ZeRO-Offload steps on the
  host) stepping one flat fp32 partition with its gradient in each of P processes at once, started together (a
  barrier), as the P ranks of a node step theirs after the backward pass. Rate = P x partition x steps / the slowest
  process's time: parameters per second per node, the unit of `Hardware.cpu_adam_params_per_s`. Each process runs
  `threads` OpenMP threads: cpu_adam.h parallelises its loop with `omp parallel for`, and `accelerate launch` on
  GPUs sets OMP_NUM_THREADS to 1 in every rank unless OMP_NUM_THREADS or --num_cpu_threads_per_process is given
  (accelerate/commands/launch.py `num_cpu_threads_per_process`, utils/launch.py), so 1 is what a job gets by
  default. The op is built (or loaded) once here first, in the node-local folder a job's ranks use
  (`environment.extensions`), so the processes time the steps, not a build.
- Collectives: `comm.commbench`'s launch (real ranks; NCCL on GPUs, Gloo on CPU) or a commbench JSON given; the bus
  bandwidth of all_gather and reduce_scatter (ZeRO's collectives) at the largest size. One host: intra-node. Several
  hosts: the network's rate per GPU, from the bytes `planning.comm.all_gather_bytes` says cross nodes.
- GPU only (CUDA visible): host <-> device copies of pinned memory (as the generated JSON's `pin_memory` offload), and
  the matmuls of one decoder layer of the model (bf16, one micro batch of tokens) as achieved TFLOP/s.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial

from hf_dist_recipes.planning.calibration import RATE_KINDS, Profile, Rate
from hf_dist_recipes.planning.comm import Span, all_gather_bytes

DEFAULT_PARTITION_PARAMS = 50_000_000  # 800 MB of fp32 state per process: many cache sizes, a few steps per second
# The largest partition one process steps here: a step streams the parameter, gradient and both moments once, so
# once they are far out of cache its time grows with the partition and the rate per parameter stays (a plan's larger
# partition is measured at this size, and the profile says so). Below a few million parameters per-call overheads
# show: on this repository's shared 2-core host, 1 thread, 5 steps: 2M 2.9e8, 20M 7.6e8, 50M 4.8e8 params/s (the
# spread between the last two is other jobs' load; more steps average it).
MAX_MEASURED_PARAMS = 200_000_000
STATE_BYTES = 16  # fp32 parameter, gradient, exp_avg, exp_avg_sq
DEFAULT_STEPS = 10
HOST_MEMORY_SHARE = 0.5  # at most this share of the available memory for the partitions
COLLECTIVE_SIZES = (1 << 20, 16 << 20)  # bytes; large enough for the bandwidth term, quick on Gloo
COPY_BYTES = 256 << 20
DEFAULT_MATMUL = (4096, 8192, 8192)  # tokens, in, out: without a model, one square-ish layer matmul


def default_threads(environ: dict | None = None) -> int:
    """OpenMP threads per process a launched rank gets: OMP_NUM_THREADS when set, else 1 (accelerate's default)."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


@dataclass(frozen=True)
class CalibrationSettings:
    """What to measure. `partition_params`: the CPU Adam partition one process steps (`plan_partition_params`: the
    plan's, when sized from a plan); `processes` stepping at once with `threads` each; `steps` timed after one
    warm-up; `commbench_file`: a commbench JSON to read instead of launching; `collective_processes`: ranks to
    launch (None: commbench's default); `model`, `tokens`, `ep`: the layer whose matmuls are timed on a GPU;
    `context`: recorded in the profile as given (the plan)."""

    partition_params: int = DEFAULT_PARTITION_PARAMS
    processes: int = 1
    threads: int = 1
    steps: int = DEFAULT_STEPS
    plan_partition_params: int | None = None
    commbench_file: str | None = None
    collective_processes: int | None = None
    skip_collectives: bool = False
    model: object = None
    tokens: int = 4096
    ep: int = 1
    context: dict = field(default_factory=dict)


def check_settings(s: CalibrationSettings, available_bytes: int | None = None) -> CalibrationSettings:
    """`s`, or ValueError naming the flag to change (the partitions must fit in HOST_MEMORY_SHARE of the memory)."""
    for flag, value, example in (
        ("--partition-params", s.partition_params, 20_000_000),
        ("--processes", s.processes, 1),
        ("--threads-per-process", s.threads, 1),
        ("--steps", s.steps, DEFAULT_STEPS),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}; e.g. {flag} {example}")
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    need = STATE_BYTES * s.partition_params * s.processes
    if need > HOST_MEMORY_SHARE * available_bytes:
        fit = int(HOST_MEMORY_SHARE * available_bytes / (STATE_BYTES * s.processes))
        raise ValueError(
            f"{s.processes} CPU Adam partition(s) of {s.partition_params:,} parameters need {need / 1e9:.1f} GB of "
            f"fp32 state, more than half of the {available_bytes / 1e9:.1f} GB available; e.g. --partition-params {fit}"
        )
    return s


def _cpu_adam_process(partition: int, threads: int, steps: int, barrier, results) -> None:
    """One process: a partition of `partition` fp32 parameters with a gradient, one warm-up step, the barrier, then
    `steps` timed steps; puts (seconds, None) or (None, the error) on `results`."""
    import sys

    os.environ["OMP_NUM_THREADS"] = str(threads)
    # DeepSpeed's logger binds the stdout it sees at import and prints an accelerator notice: it would land in the
    # parent's stdout (calibrate --json). Nothing of this process belongs there.
    sys.stdout = sys.stderr
    try:
        import torch

        torch.set_num_threads(threads)  # torch sets OpenMP's team size, the one cpu_adam's loop uses
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param = torch.nn.Parameter(torch.zeros(partition, dtype=torch.float32))
        param.grad = torch.full_like(param, 1e-3)
        optimizer = DeepSpeedCPUAdam([param], lr=1e-4)
        optimizer.step()  # first touch of the moments, allocated lazily in the first step
        barrier.wait(timeout=600)
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        results.put((time.perf_counter() - start, None))
    except BaseException as err:  # noqa: BLE001 - reported by the parent, with the process's message
        results.put((None, f"{type(err).__name__}: {err}"))
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001 - the barrier may be gone with the parent
            pass


def build_cpu_adam(progress: Callable[[str], None]) -> float:
    """Load DeepSpeed's cpu_adam op, JIT-building it first where a job's ranks would (the node-local folder);
    returns the seconds it took."""
    from hf_dist_recipes.environment.extensions import use_node_local_extensions_dir

    folder = use_node_local_extensions_dir()
    progress(f"loading DeepSpeed's cpu_adam op from {folder} (built on first use: a minute or more)")
    start = time.perf_counter()
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # the build's and DeepSpeed's notices stay off stdout (--json)
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    return time.perf_counter() - start


def cpu_adam_rate(s: CalibrationSettings, progress: Callable[[str], None]) -> Rate:
    """DeepSpeed's CPU Adam rate on this host in parameters per second per node (see the module docstring)."""
    import multiprocessing

    build_s = build_cpu_adam(progress)
    progress(
        f"CPU Adam: {s.processes} process(es) x {s.partition_params:,} parameters, {s.threads} thread(s) each, "
        f"{s.steps} steps (op ready in {build_s:.0f} s)"
    )
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, as ranks are: no OpenMP pool inherited
    barrier, results = ctx.Barrier(s.processes), ctx.Queue()
    procs = [
        ctx.Process(
            target=_cpu_adam_process,
            args=(s.partition_params, s.threads, s.steps, barrier, results),
            name=f"cpu-adam-{i}",
            daemon=True,
        )
        for i in range(s.processes)
    ]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(results.get(timeout=900))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    errors = [e for _, e in got if e]
    if errors:
        raise RuntimeError(f"CPU Adam measurement failed in a process: {errors[0]}")
    slowest = max(t for t, _ in got)
    rate = s.processes * s.partition_params * s.steps / slowest
    sized = (
        f"; the plan's partition is {s.plan_partition_params:,}, measured at {s.partition_params:,} (the rate per "
        "parameter is flat at these sizes: memory-bandwidth bound)"
        if s.plan_partition_params and s.plan_partition_params != s.partition_params
        else ""
    )
    how = (
        f"DeepSpeedCPUAdam.step on {s.processes} process(es) at once, {s.partition_params:,} fp32 parameters "
        f"each, {s.threads} OpenMP thread(s) per process, {s.steps} steps, slowest process {slowest:.2f} s{sized}"
    )
    progress(f"CPU Adam: {rate:.3g} params/s per node ({slowest / s.steps:.3f} s per step)")
    return Rate(rate, RATE_KINDS["cpu_adam_params_per_s"].unit, how)


def collective_rates(result: dict, source: str) -> dict[str, Rate]:
    """{"intra_node_gbps" or "inter_node_gbps": Rate} from a commbench result (one run, not the side-by-side):
    the mean bus bandwidth of all_gather and reduce_scatter at the largest size measured on one host; across hosts
    the network's bytes per GPU (`all_gather_bytes`: (n-1)/n x S/m for n hosts of m ranks) over the time, which
    counts the time inside the node as network time (a slight under-estimate)."""
    if result.get("side_by_side"):
        result = result["runs"][0]  # the NCCL run: the one a GPU job uses
    rows = [
        r
        for r in result.get("results", [])
        if r.get("op") in ("all_gather", "reduce_scatter") and r.get("time_us") and r.get("busbw_GBps")
    ]
    if not rows:
        raise ValueError(
            f"{source} has no all_gather or reduce_scatter result with a time; run hf-dist-recipes commbench --json "
            "and pass its output"
        )
    size = max(r["size_bytes"] for r in rows)
    rows = [r for r in rows if r["size_bytes"] == size]
    world, hosts = int(result["world_size"]), max(1, len(result.get("hosts") or [""]))
    backend = result.get("backend", "?")
    what = f"{backend}, {world} ranks on {hosts} host(s), all_gather/reduce_scatter at {size:,} bytes ({source})"
    if hosts == 1:
        bus = statistics.mean(r["busbw_GBps"] for r in rows)
        return {"intra_node_gbps": Rate(bus, RATE_KINDS["intra_node_gbps"].unit, f"bus bandwidth, {what}")}
    span = Span(hosts, max(1, world // hosts))
    inter = all_gather_bytes(size, span)[1]
    per_gpu = statistics.mean(inter / (r["time_us"] * 1e-6) / 1e9 for r in rows)
    how = f"network bytes per GPU ((n-1)/n x S/m) over the time, {what}"
    return {"inter_node_gbps": Rate(per_gpu, RATE_KINDS["inter_node_gbps"].unit, how)}


def launch_collectives(processes: int | None, progress: Callable[[str], None]) -> tuple[dict, str]:
    """Run commbench's ranks on this host (its launch: torchrun, NCCL on GPUs, Gloo on CPU), short settings."""
    from hf_dist_recipes.comm.commbench import BenchSettings
    from hf_dist_recipes.comm.commbench_launch import plan_commbench, run_commbench

    plan = plan_commbench(
        BenchSettings(sizes=COLLECTIVE_SIZES, iters=5, warmup=2, link_bytes=1 << 20), num_processes=processes
    )
    progress(f"collectives: commbench on {plan.num_processes} local ranks ({plan.backends[0]})")
    return run_commbench(plan), f"commbench launched by calibrate on {socket.gethostname()}"


def _cuda_seconds(work: Callable[[], object], iters: int = 10) -> float:
    """Seconds of one call of `work` (queued GPU work): the mean of `iters` timed with CUDA events, after one."""
    import torch

    work()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth() -> Rate:
    """Host <-> GPU copies of COPY_BYTES of pinned memory, each way, timed with CUDA events; the rate is their
    harmonic mean (offload moves about as many bytes each way)."""
    import torch

    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    speeds = {}
    for name, (dst, src) in {"host->GPU": (dev, host), "GPU->host": (host, dev)}.items():
        speeds[name] = COPY_BYTES / _cuda_seconds(partial(dst.copy_, src, non_blocking=True)) / 1e9
    value = 2 / sum(1 / v for v in speeds.values())
    how = "pinned copies of 256 MiB, " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in speeds.items()) + " (harmonic mean)"
    return Rate(value, RATE_KINDS["pcie_gbps"].unit, how)


def layer_matmuls(model, tokens: int, ep: int = 1) -> list[tuple[int, int, int, int]]:
    """(batch, rows, in, out) of the matmuls of one decoder layer's weights (the first with routed experts, else the
    first): each 2-D weight at `tokens` rows; routed experts batched, E / ep of them on a rank with
    ep x tokens x k / E rows each (even routing). Without a model: DEFAULT_MATMUL."""
    if model is None:
        t, i, o = DEFAULT_MATMUL
        return [(1, t, i, o)]
    layer_names = (
        sorted({n.split(".mlp.")[0] for n, _ in model.parameters if ".experts." in n})
        or [n.rsplit(".", 2)[0] for n, _ in model.parameters if n.endswith("o_proj.weight")][:1]
    )
    prefix = layer_names[0] + "." if layer_names else ""
    out = []
    for name, shape in model.parameters:
        if not name.startswith(prefix) or len(shape) < 2 or name.endswith("mlp.gate.weight"):
            continue
        if len(shape) == 3:  # fused routed experts (E, out, in)
            experts = max(1, shape[0] // ep)
            rows = math.ceil(ep * tokens * model.experts_per_token / shape[0])
            out.append((experts, rows, shape[2], shape[1]))
        elif ".experts." in name:  # one expert's own weight
            rows = math.ceil(ep * tokens * model.experts_per_token / model.routed_experts)
            out.append((1, rows, shape[1], shape[0]))
        else:
            out.append((1, tokens, shape[1], shape[0]))
    return out


def matmul_tflops(model, tokens: int, ep: int = 1) -> Rate:
    """Achieved bf16 TFLOP/s over the forward matmuls of one layer (`layer_matmuls`), timed with CUDA events: what
    the step model's compute term assumes the matmuls reach (its `compute_efficiency` x peak). Attention's score
    matrix, norms and the backward's other kernels are not in it, so it bounds the step's efficiency from above."""
    import torch

    shapes = layer_matmuls(model, tokens, ep)
    flops, seconds = 0.0, 0.0
    for batch, rows, k, n in shapes:
        x = torch.randn(batch, rows, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(batch, k, n, dtype=torch.bfloat16, device="cuda")
        seconds += _cuda_seconds(partial(torch.bmm, x, w))
        flops += 2.0 * batch * rows * k * n
        del x, w
    name = getattr(model, "name", None) or "no model (a {}x{}x{} matmul)".format(*DEFAULT_MATMUL)
    how = (
        f"bf16 forward matmuls of one layer of {name}, {len(shapes)} weight(s), {tokens} tokens, EP {ep}, on "
        f"{torch.cuda.get_device_name()}; an upper bound of the step's efficiency (no attention scores, norms)"
    )
    return Rate(flops / seconds / 1e12, RATE_KINDS["matmul_tflops"].unit, how)


def _versions() -> dict[str, str]:
    from hf_dist_recipes.environment.fingerprint import installed_version

    return {dist: installed_version(dist) or "not installed" for dist in ("torch", "deepspeed", "hf-dist-recipes")}


def calibrate(s: CalibrationSettings, progress: Callable[[str], None] = lambda line: None) -> Profile:
    """Measure every rate this host can (see the module docstring) and return the profile; what it cannot is
    recorded as assumed, with why."""
    import torch

    cuda = torch.cuda.is_available()
    rates: dict[str, Rate] = {}
    notes: list[str] = []
    rates["cpu_adam_params_per_s"] = cpu_adam_rate(s, progress)

    if s.commbench_file:
        from hf_dist_recipes.core.jsonfile import read_json_object

        data = read_json_object(s.commbench_file, "commbench result", "write one with hf-dist-recipes commbench --json")
        rates.update(collective_rates(data, f"commbench JSON {s.commbench_file}"))
    elif not s.skip_collectives:
        try:
            result, source = launch_collectives(s.collective_processes, progress)
            rates.update(collective_rates(result, source))
        except ValueError as err:  # e.g. one GPU: no GPU-to-GPU link to measure
            notes.append(f"collectives not measured: {err}")
    if "intra_node_gbps" in rates:
        progress(f"collectives: {rates['intra_node_gbps'].value:.3g} GB/s bus bandwidth inside the node")
        if not cuda:
            notes.append(
                "intra_node_gbps is Gloo's between CPU processes: right for a CPU job, far below NCCL on a GPU node"
            )
    if cuda:
        progress("GPU: pinned host <-> device copies, one layer's matmuls")
        rates["pcie_gbps"] = copy_bandwidth()
        rates["matmul_tflops"] = matmul_tflops(s.model, s.tokens, s.ep)
    no_gpu = "no CUDA device on this host: the estimate keeps the --hardware preset's value"
    why_not = {
        "pcie_gbps": no_gpu,
        "matmul_tflops": no_gpu,
        "intra_node_gbps": "not measured (no collective run): the preset's value",
        "inter_node_gbps": "one host measures no network: run commbench across two nodes of the job, then "
        "calibrate --commbench FILE",
        "cpu_adam_params_per_s": "",
    }
    for key, kind in RATE_KINDS.items():
        rates.setdefault(key, Rate(None, kind.unit, why_not[key], assumed=True))
    context = {
        "partition_params": s.partition_params,
        "plan_partition_params": s.plan_partition_params,
        "processes": s.processes,
        "threads_per_process": s.threads,
        "steps": s.steps,
        **s.context,
    }
    device = f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if cuda else "cpu"
    return Profile(
        host=socket.gethostname(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        versions=_versions(),
        device=device,
        context=context,
        rates={k: rates[k] for k in RATE_KINDS},
        notes=notes,
    )
