"""SystemMetricsCallback: what the machine and process look like on this rank, sampled at each logging step.

Keys it adds to the log of each logging step (so the per-rank TensorBoard run shows them as `train/<key>`; the
sampling cost is bounded by the logging frequency, and measured in benchmarks/system_metrics.py):
- `system/rss_gib`: this process's resident memory (psutil), GiB;
- `system/cpu_percent`: this process's CPU use since the previous sample (psutil; 100 = one core busy, so it can
  exceed 100 with several threads);
- with CUDA: `gpu/max_allocated_gib`, `gpu/max_reserved_gib`: torch's peak allocated / reserved memory on this
  rank's device since the start (torch.cuda), GiB;
- with NVML (nvidia-ml-py, a dependency of the package, and a driver), on a run that trains on CUDA
  devices: `gpu/utilization_percent` (busy time over the driver's last sample period), `gpu/memory_used_gib` (the
  whole device, every process), GiB, `gpu/power_w`, watts.
A run on the CPU does not try NVML and says nothing about it: there is no GPU of its own to sample (`make demo` on a
host without one printed "NVML unavailable" from every rank, issue 30). When NVML cannot be used on a GPU run (not
installed, no driver) the first log of each rank carries the text `system/nvml` saying why, and the console says it
once: the ranks gather their reasons at train begin (one `all_gather_object`, GPU runs only) and rank 0 logs one
warning per reason, naming its ranks. The GPU keys from NVML are then absent. Never an error.

These are this rank's wall-clock measurements (and one text), so they stay out of `log_history` and `report_to`
(a resumed run would not log them again alike; integrations expect numbers): they go to the runtime's `rank`
channel, which the per-rank TensorBoard callback writes; it needs no knowledge of this one.

The spread over ranks goes to every `report_to` integration too (the runtime's `job` channel: the same on every
rank, not in `log_history`), so a W&B or MLflow user sees the rank that holds the most memory without TensorBoard:
`system/rss_gib_max` and `system/rss_gib_max_rank` (and with CUDA `gpu/max_reserved_gib_max` and
`gpu/max_reserved_gib_max_rank`): the largest value over ranks and the rank holding it. One all-gather of two floats
per rank at each logging step (every rank logs at the same steps).

`RunIdentity` / `launch_identity`: host name, rank, local rank and a run id agreed by all ranks of one launch
(rank 0 draws it and broadcasts it), recorded in each rank's TensorBoard run and summary.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

import torch

from hf_dist_recipes.core.gather import gather_floats, gather_objects
from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.monitoring.console import rank_list, warn_once
from hf_dist_recipes.runtime import RecipeCallback

logger = logging.getLogger(__name__)

NVML_KEYS_ABSENT = "no gpu/utilization_percent, gpu/memory_used_gib, gpu/power_w"


@dataclass(frozen=True)
class RunIdentity:
    host: str
    rank: int
    local_rank: int
    run_id: str

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        # key=value: `logs summarize` (monitoring/events.py) reads the host back from the `run` text
        return f"host={self.host} rank={self.rank} local_rank={self.local_rank} run_id={self.run_id}"


_run_id: str | None = None  # one per launch (process), drawn at its first train begin


def launch_identity(args) -> RunIdentity:
    """This rank's identity in this launch. The run id is drawn once per process, by rank 0, and broadcast when
    torch.distributed runs with several ranks: collective the first time, so every rank calls it at train begin.
    Several `train()` calls of one process (a script that trains twice) share it."""
    global _run_id
    if _run_id is None:
        # UTC time of the launch plus 8 random hex digits: sorts by time, unique across hosts.
        run_id = [time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]]
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            torch.distributed.broadcast_object_list(run_id, src=0)
        _run_id = run_id[0]
    local_rank = args.local_process_index if getattr(args, "local_process_index", None) is not None else 0
    return RunIdentity(socket.gethostname(), int(args.process_index), int(local_rank), _run_id)


class SystemMetricsCallback(RecipeCallback):
    """See the module docstring for the keys. `nvml`: the pynvml module to use (None: import `pynvml`); tests pass
    a fake one to cover GPU hosts on a machine without them. The samples go to the run's runtime (its log sink)."""

    def __init__(self, nvml=None):
        self._nvml_module = nvml
        self._nvml = None  # the module once initialised
        self._nvml_handle = None
        self._nvml_note: str | None = None  # why NVML is unavailable, reported once
        self._nvml_tried = False
        self._rank = 0
        self._process = None

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        import psutil

        if self._process is None:
            self._process = psutil.Process()
        self._process.cpu_percent(None)  # starts the interval the first sample measures
        if not self._nvml_tried:
            self._nvml_tried = True
            self._rank = self.runtime.facts.rank
            # Training on a GPU: the same on every rank, so is the gather in _init_nvml.
            if getattr(getattr(args, "device", None), "type", None) == "cuda":
                self._init_nvml(args)

    def _init_nvml(self, args) -> None:
        reason = None
        try:
            nvml = self._nvml_module
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._nvml_handle = nvml.nvmlDeviceGetHandleByIndex(_device_index(args))
            self._nvml = nvml
        except Exception as e:  # ImportError, NVMLError (no driver, no device): GPU keys absent, never a crash
            reason = f"{type(e).__name__}: {e}"
            self._nvml_note = f"NVML unavailable, {NVML_KEYS_ABSENT}: {reason}"
        by_reason: dict[str, list[int]] = {}
        for rank, why in enumerate(gather_objects(reason)):
            if why is not None:
                by_reason.setdefault(why, []).append(rank)
        for why, ranks in by_reason.items():
            warn_once(logger, "NVML unavailable on rank(s) %s, %s: %s", rank_list(ranks), NVML_KEYS_ABSENT, why)

    def sample(self) -> dict[str, float]:
        """One sample of every available key (see the module docstring)."""
        out: dict[str, float] = {}
        if self._process is not None:
            with self._process.oneshot():
                out["system/rss_gib"] = self._process.memory_info().rss / GIB
                out["system/cpu_percent"] = self._process.cpu_percent(None)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu/max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            out["gpu/max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        if self._nvml is not None:
            try:
                out["gpu/utilization_percent"] = float(self._nvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu)
                out["gpu/memory_used_gib"] = self._nvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used / GIB
                out["gpu/power_w"] = self._nvml.nvmlDeviceGetPowerUsage(self._nvml_handle) / 1000.0  # milliwatts
            except Exception as e:  # a device that stops answering mid-run: stop asking, say so once
                self._nvml = None
                self._nvml_note = f"NVML stopped answering: {type(e).__name__}: {e}"
                logger.warning("rank %s: %s", self._rank, self._nvml_note)  # this rank's own event, said by it
        return out

    def on_step_end(self, args, state, control, **kwargs):
        # DefaultFlowCallback (first in the list) has decided by now whether this step logs: sample only then.
        if control.should_log:
            sample = self.sample()
            self.runtime.logs.rank(sample)
            self.runtime.logs.job(spread_over_ranks(sample))
            if self._nvml_note is not None:
                self.runtime.logs.rank({"system/nvml": self._nvml_note})
                self._nvml_note = None


SPREAD_KEYS = ("system/rss_gib", "gpu/max_reserved_gib")


def spread_over_ranks(sample: dict[str, float]) -> dict[str, float]:
    """The largest value over ranks of each `SPREAD_KEYS` key, and the rank holding it (`<key>_max`,
    `<key>_max_rank`); one all-gather. A key no rank sampled is left out; every rank gets the same dict."""
    rows = gather_floats([sample.get(key, math.nan) for key in SPREAD_KEYS])
    out: dict[str, float] = {}
    for i, key in enumerate(SPREAD_KEYS):
        values = [(row[i], rank) for rank, row in enumerate(rows) if not math.isnan(row[i])]
        if values:
            value, rank = max(values)
            out[f"{key}_max"], out[f"{key}_max_rank"] = value, float(rank)
    return out


def _device_index(args) -> int:
    """NVML index of this rank's GPU. NVML numbers every device of the host and ignores CUDA_VISIBLE_DEVICES, so
    the visible device is mapped back through that list when it names plain indices."""
    index = torch.cuda.current_device() if torch.cuda.is_available() else int(getattr(args, "local_process_index", 0))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if names and all(n.isdigit() for n in names) and index < len(names):
        return int(names[index])
    return index
