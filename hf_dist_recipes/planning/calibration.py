"""A calibration profile: the step model's rates as measured on the machines a job will use, written by
`hf-dist-recipes calibrate` and read by `config estimate / generate --profile FILE`.

Every rate of `planning.comm.Hardware` that decides between plans is an assumption until measured: the matmuls'
fraction of the GPU's peak (0.5), CPU Adam's parameters per second per node (2e9), host <-> GPU copies (25 GB/s),
NCCL's bus bandwidth inside a node (360 GB/s on H100) and across nodes (45 GB/s per GPU). A profile holds each rate
with its value, unit and how it was measured, or `assumed: true` (value null) where this host could not measure it
(no GPU: no PCIe copy and no matmul; one host: no network), so a reader knows which terms of the estimate are still
guesses. Precedence when the estimate builds its Hardware: an explicit flag (`--cpu-adam-rate`, ...) > the profile's
measured rate > the `--hardware` preset (`hardware_with`).

The profile's matmul rate is achieved TFLOP/s, not a fraction: the estimate divides it by the peak it uses
(`--gpu-tflops`, else the preset's), so one profile serves whichever peak the estimate is told.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hf_dist_recipes.core.files import write_atomically
from hf_dist_recipes.core.jsonfile import read_json_object
from hf_dist_recipes.planning.comm import Hardware

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RateKind:
    """One rate a profile can hold: the Hardware field it sets, its unit, what measures it, and the estimate's
    term it scales (what to say a difference between plans comes from)."""

    key: str
    field: str
    unit: str
    measurement: str
    term: str


RATE_KINDS = {
    k.key: k
    for k in (
        RateKind(
            "cpu_adam_params_per_s",
            "cpu_adam_params_per_s",
            "params/s per node",
            "DeepSpeed's CPU Adam rate (hf-dist-recipes calibrate on a node of the job)",
            "CPU Adam",
        ),
        RateKind(
            "pcie_gbps",
            "pcie_gbps",
            "GB/s",
            "host <-> GPU copy bandwidth (hf-dist-recipes calibrate on a GPU node)",
            "offload copies",
        ),
        RateKind(
            "intra_node_gbps",
            "intra_node_gbps",
            "GB/s",
            "bus bandwidth inside a node (hf-dist-recipes calibrate, or commbench, on a node of the job)",
            "collectives inside the node",
        ),
        RateKind(
            "inter_node_gbps",
            "inter_node_gbps",
            "GB/s per GPU",
            "network bandwidth across nodes (commbench launched across two nodes, then calibrate --commbench FILE)",
            "collectives across nodes",
        ),
        RateKind(
            "matmul_tflops",
            "compute_efficiency",
            "TFLOP/s",
            "matmul throughput of one layer (hf-dist-recipes calibrate on a GPU node)",
            "compute",
        ),
    )
}
# The Hardware fields a profile can set, and which profile key sets each.
FIELD_KEYS = {k.field: k.key for k in RATE_KINDS.values()}
# The flag that overrides each field (cli/plan_inputs.py's hardware group), named in the provenance.
FIELD_FLAGS = {
    "cpu_adam_params_per_s": "--cpu-adam-rate",
    "pcie_gbps": "--pcie-gbps",
    "intra_node_gbps": "--intra-node-gbps",
    "inter_node_gbps": "--inter-node-gbps",
    "compute_efficiency": "--compute-efficiency",
}
# How far a rate may be from the truth, as a factor (1 + error) either way. Assumed: the presets' values are
# typical, not yours: CPU Adam varies over 10x with cores and OpenMP threads per rank, PCIe between generations and
# with pinned or pageable memory (2x), MFU between 0.3 and 0.6 for the same model, achieved network bandwidth with
# the fabric's tuning. Measured (or set by a flag, taken as measured): the spread of repeated runs and the gap
# between a benchmark and the job's own pattern, about 10%.
ASSUMED_ERROR = 0.5
MEASURED_ERROR = 0.1

PROFILE_HINT = "write one with: hf-dist-recipes calibrate --output FILE, then pass --profile FILE"


@dataclass(frozen=True)
class Rate:
    """One rate of a profile: `value` in `unit` (None when `assumed`), `how` it was measured or why not."""

    value: float | None
    unit: str
    how: str
    assumed: bool = False


@dataclass(frozen=True)
class Profile:
    """What `calibrate` measured on one host. `context`: what the measurements were sized by (the CPU Adam
    partition, processes and threads per process, the model and plan when given); `rates`: every key of
    RATE_KINDS, measured or assumed."""

    host: str
    created: str
    versions: dict[str, str]
    device: str
    context: dict
    rates: dict[str, Rate]
    schema_version: int = SCHEMA_VERSION
    notes: list[str] = field(default_factory=list)

    def measured(self) -> list[str]:
        return [k for k, r in self.rates.items() if not r.assumed]

    def assumed(self) -> list[str]:
        return [k for k, r in self.rates.items() if r.assumed]

    def as_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            **{k: v for k, v in asdict(self).items() if k != "schema_version"},
        }


def check_output(path: str | Path) -> Path:
    """`path` as a Path when a profile can be written there (checked before minutes of measuring), else ValueError
    naming --output."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--output {p} is a directory; give a file name, e.g. --output {p / 'profile.json'}")
    from hf_dist_recipes.core.user_values import writable_dir

    try:
        writable_dir(p.parent, "--output", "profile.json")
    except ValueError as err:
        raise ValueError(f"--output {p}: its folder cannot be written ({err})") from None
    return p


def write_profile(profile: Profile, path: str | Path) -> Path:
    """Write `profile` as JSON to `path` (atomically: an estimate reading it meanwhile sees the old or the new)."""
    p = check_output(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(p, json.dumps(profile.as_dict(), indent=2) + "\n")
    return p


def read_profile(path: str | Path) -> Profile:
    """The Profile in `path`, or ValueError naming the file, the problem and the fix."""
    data = read_json_object(path, "profile", PROFILE_HINT)
    where = f"profile {path}"
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{where} has schema_version {version!r}, this version reads {SCHEMA_VERSION}; write it again with "
            "hf-dist-recipes calibrate --output FILE"
        )
    rates_in = data.get("rates")
    if not isinstance(rates_in, dict):
        raise ValueError(f"{where} has no 'rates' object; {PROFILE_HINT}")
    unknown = sorted(set(rates_in) - set(RATE_KINDS))
    if unknown:
        raise ValueError(f"{where} has unknown rate(s) {', '.join(unknown)}; the rates are {', '.join(RATE_KINDS)}")
    rates = {}
    for key, raw in rates_in.items():
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: rates.{key} must be an object with value, unit, how, assumed")
        assumed, value = raw.get("assumed", False), raw.get("value")
        if not isinstance(assumed, bool):
            raise ValueError(f"{where}: rates.{key}.assumed must be true or false, got {assumed!r}")
        if not assumed and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ):
            raise ValueError(
                f"{where}: rates.{key}.value must be a positive number ({RATE_KINDS[key].unit}), got {value!r}; "
                f'measure it again with hf-dist-recipes calibrate, or mark it "assumed": true'
            )
        rates[key] = Rate(
            value=None if assumed else float(value),
            unit=str(raw.get("unit", RATE_KINDS[key].unit)),
            how=str(raw.get("how", "")),
            assumed=assumed,
        )
    for key in RATE_KINDS:  # a rate the file leaves out is one it did not measure
        rates.setdefault(key, Rate(None, RATE_KINDS[key].unit, "not in the profile", assumed=True))
    return Profile(
        host=str(data.get("host", "")),
        created=str(data.get("created", "")),
        versions=dict(data.get("versions") or {}),
        device=str(data.get("device", "")),
        context=dict(data.get("context") or {}),
        rates=rates,
        notes=list(data.get("notes") or []),
    )


@dataclass(frozen=True)
class RateSource:
    """Where one Hardware rate of an estimate came from: "flag", "profile" or "assumed" (the preset), in words."""

    field: str
    value: float
    source: str
    detail: str

    @property
    def error(self) -> float:
        """The relative error the runner-up analysis allows this rate (ASSUMED_ERROR or MEASURED_ERROR)."""
        return ASSUMED_ERROR if self.source == "assumed" else MEASURED_ERROR


def hardware_with(
    base: Hardware, profile: Profile | None = None, flags: dict[str, float] | None = None, *, profile_path: str = ""
) -> tuple[Hardware, dict[str, RateSource]]:
    """`base` (a preset) with the profile's measured rates on top and the explicit `flags` ({Hardware field: value},
    the fields the user set) on top of those; and where each rate of FIELD_KEYS came from. The matmul rate becomes
    compute_efficiency = measured TFLOP/s / the peak in use (`gpu_tflops`, a flag's if given), at most 1."""
    flags = dict(flags or {})
    peak = flags.get("gpu_tflops", base.gpu_tflops)
    changes: dict[str, float] = {}
    sources: dict[str, RateSource] = {}
    for fld, key in FIELD_KEYS.items():
        if fld in flags:
            sources[fld] = RateSource(fld, flags[fld], "flag", FIELD_FLAGS[fld])
            continue
        rate = profile.rates.get(key) if profile else None
        if rate is not None and not rate.assumed:
            value = min(1.0, rate.value / peak) if key == "matmul_tflops" else rate.value
            shown = (
                f"{rate.value:,.0f} TFLOP/s of {peak:g} peak"
                if key == "matmul_tflops"
                else f"{rate.value:.4g} {rate.unit}"
            )
            changes[fld] = value
            sources[fld] = RateSource(fld, value, "profile", f"{profile_path or 'profile'}: {shown}, {rate.how}")
        else:
            why = f"; profile: {profile.rates[key].how}" if profile and profile.rates[key].how else ""
            sources[fld] = RateSource(fld, getattr(base, fld), "assumed", f"--hardware {base.name}'s value{why}")
    hw = replace(base, **changes, **flags)
    for fld, src in sources.items():  # the value actually used, after the flags
        sources[fld] = replace(src, value=getattr(hw, fld))
    return hw, sources


def profile_warnings(
    profile: Profile | None, sources: dict[str, RateSource], device: str, procs_per_node: int | None = None
) -> list[str]:
    """Warnings when a profile's rates were measured unlike the plan runs: on a CPU host for a GPU plan (`device`
    "cuda"; Gloo between CPU processes is no measure of NCCL inside a GPU node), or CPU Adam with another number of
    processes than the plan's `procs_per_node` (the rate is the node's with that many processes stepping at once)."""
    if profile is None:
        return []
    used = [f for f, s in sources.items() if s.source == "profile"]
    out = []
    if device == "cuda" and profile.device == "cpu" and "intra_node_gbps" in used:
        out.append(
            f"the profile measured intra_node_gbps on a CPU host ({profile.host}: Gloo between processes), not NCCL "
            "between GPUs; calibrate on a GPU node of the job, or pass --intra-node-gbps"
        )
    measured_with = profile.context.get("processes")
    if "cpu_adam_params_per_s" in used and procs_per_node and measured_with not in (None, procs_per_node):
        out.append(
            f"the profile's CPU Adam rate is the node's with {measured_with} process(es) stepping at once, the plan "
            f"runs {procs_per_node} per node; measure at the plan's: hf-dist-recipes calibrate --processes "
            f"{procs_per_node} (or --model with the plan's flags)"
        )
    return out


def render_sources(sources: dict[str, RateSource]) -> list[str]:
    """One line per rate: its value, and whether it was measured (profile), given (flag) or assumed."""
    units = {k.field: ("" if k.field == "compute_efficiency" else " " + k.unit) for k in RATE_KINDS.values()}
    return [f"{fld} {s.value:.4g}{units[fld]}: {s.source} ({s.detail})" for fld, s in sources.items()]
