"""Read an accelerate YAML with its DeepSpeed JSON and check that they agree, before anything is launched.

A mismatch found here costs a second; found by DeepSpeed it costs a cluster allocation and a traceback per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml

from hf_dist_recipes.core.jsonfile import load_deepspeed_json, read_text_file
from hf_dist_recipes.parallel.batch import data_parallel_size
from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView
from hf_dist_recipes.planning.sequence_parallel import yaml_sp_size


@dataclass(frozen=True)
class LaunchConfig:
    """A user's launch files read once: the accelerate YAML and the DeepSpeed JSON it names, as every consumer
    (`config validate`, the demo's launcher, the preflight and its ranks) hands them on. `num_processes` counts
    all machines' processes (accelerate's meaning); `deepspeed` is the parsed JSON named by
    `deepspeed_config_file`; `raw` the whole YAML mapping, for checks of keys not modelled here.

    The JSON is read once, on first use (`view`: the ZeRO stage, TP and EP degrees, batch numbers), so that a
    malformed value raises where it is first needed (`check_launch_config`, the lint) and nowhere earlier."""

    path: Path
    distributed_type: str
    num_processes: int
    num_machines: int
    use_cpu: bool
    deepspeed_file: Path | None
    deepspeed: dict | None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def deepspeed_source(self) -> str:
        """Where the DeepSpeed config comes from, for messages: the JSON's path, or the YAML's inline settings."""
        return str(self.deepspeed_file) if self.deepspeed_file else f"{self.path} (inline deepspeed_config)"

    @cached_property
    def view(self) -> DeepSpeedView:
        """The DeepSpeed JSON as DeepSpeed reads it (an empty one without DeepSpeed); ValueError where it refuses."""
        return DeepSpeedView.read(self.deepspeed or {})


def load_launch_config(
    path: str | Path, *, root: str | Path | None = None, given_as: str = "--config-file"
) -> LaunchConfig:
    """Parse the accelerate YAML at `path`; a relative `deepspeed_config_file` is resolved against `root` (the
    directory `accelerate launch` will run in; default: the current directory). Raises ValueError naming the file;
    a missing one names how the command was given it (`given_as`: its flag, or its argument's name)."""
    p = Path(path)
    text = read_text_file(p, "accelerate config", f"pass an existing file as {given_as}")
    if not text.strip():
        raise ValueError(f"accelerate config {p} is empty; write one with hf-dist-recipes config generate")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"accelerate config {p} is not valid YAML{line}: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"accelerate config {p} must be a YAML mapping (key: value lines), not {type(data).__name__}")
    num_processes = _positive_int(data, "num_processes", p, default=1)
    num_machines = _positive_int(data, "num_machines", p, default=1)
    ds_section = data.get("deepspeed_config") or {}
    ds_name = ds_section.get("deepspeed_config_file") if isinstance(ds_section, dict) else None
    ds_file = ds_json = None
    if ds_name:
        ds_file = Path(ds_name)
        if not ds_file.is_absolute():
            ds_file = Path(root or Path.cwd()) / ds_file
        ds_json = load_deepspeed_json(ds_file)
    elif isinstance(ds_section, dict) and ds_section and str(data.get("distributed_type")) == "DEEPSPEED":
        ds_json = inline_deepspeed_config(ds_section, p)
    return LaunchConfig(
        path=p,
        distributed_type=str(data.get("distributed_type", "NO")),
        num_processes=num_processes,
        num_machines=num_machines,
        use_cpu=bool(data.get("use_cpu", False)),
        deepspeed_file=ds_file,
        deepspeed=ds_json,
        raw=data,
    )


# The DeepSpeed settings `accelerate config` writes into the YAML itself (no JSON file): `accelerate launch` hands
# each to the ranks as an ACCELERATE_DEEPSPEED_* variable, and accelerate's DeepSpeedPlugin builds the DeepSpeed
# config from them (accelerate 1.16 utils/launch.py, utils/dataclasses.py). The same plugin builds it here.
INLINE_KEYS = (
    "zero_stage",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "zero3_init_flag",
    "zero3_save_16bit_model",
)
# What `accelerate launch` sets from those keys for its ranks, and `DeepSpeedPlugin` reads for a key it is not given.
LAUNCH_VARIABLES = ("ACCELERATE_DEEPSPEED_", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING")


def inline_deepspeed_config(section: dict, path: Path) -> dict:
    """The DeepSpeed config accelerate's `DeepSpeedPlugin` builds from an accelerate YAML's inline
    `deepspeed_config` keys (batch sizes "auto", as the Trainer fills them). The variables through which an outer
    launch hands the plugin its values (`LAUNCH_VARIABLES`) are set aside meanwhile: the YAML alone is read.
    ValueError naming the file where the plugin refuses a value."""
    import os

    from accelerate.utils import DeepSpeedPlugin

    given = {key: section[key] for key in INLINE_KEYS if section.get(key) is not None}
    # Popped and put back one by one, never the whole environment cleared: another thread may read it meanwhile.
    aside = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(LAUNCH_VARIABLES)}
    try:
        return DeepSpeedPlugin(**given).deepspeed_config
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: accelerate refuses its deepspeed_config: {err}") from None
    finally:
        os.environ.update(aside)


def check_launch_config(cfg: LaunchConfig, *, num_processes: int | None = None) -> int:
    """Check that the YAML and its DeepSpeed JSON describe the same job; return the world size.

    `num_processes` overrides the YAML's value (as `accelerate launch --num_processes` does)."""
    world = cfg.num_processes if num_processes is None else num_processes
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        # 0 used to mean "the YAML's value" here: a typo'd --num-processes 0 then launched the YAML's count.
        raise ValueError(f"num_processes must be a positive integer, got {world!r}; e.g. --num-processes 2")
    if cfg.num_machines > world:
        raise ValueError(
            f"{cfg.path}: num_machines={cfg.num_machines} but num_processes={world}; accelerate counts the processes "
            "of all machines in num_processes, so it must be at least num_machines"
        )
    if cfg.deepspeed is None:
        if cfg.distributed_type == "DEEPSPEED":
            raise ValueError(
                f"{cfg.path}: distributed_type is DEEPSPEED but neither a deepspeed_config_file nor DeepSpeed settings "
                "(zero_stage, ...) are given under deepspeed_config; write both with hf-dist-recipes config generate"
            )
        return world
    if cfg.distributed_type != "DEEPSPEED":  # only a file is read without DEEPSPEED (load_launch_config)
        raise ValueError(
            f"{cfg.path}: a deepspeed_config_file is given but distributed_type is {cfg.distributed_type}; "
            "set distributed_type: DEEPSPEED"
        )
    tp, sp = cfg.view.tp, yaml_sp_size(cfg.raw)
    try:
        dp = data_parallel_size(world, tp)
    except ValueError as err:
        raise ValueError(f"{cfg.path} with {cfg.deepspeed_source}: {err}") from None
    if sp > 1 and dp % sp == 0:  # an SP group's ranks see one batch (a size that does not divide: the lint's)
        dp //= sp
    total, micro, accum = cfg.view.train_batch, cfg.view.micro_batch, cfg.view.grad_accum
    if None not in (total, micro, accum) and total != micro * accum * dp:
        layout = f"TP {tp}" + (f", SP {sp}" if sp > 1 else "")
        raise ValueError(
            f"{cfg.path} launches num_processes={world} ({layout}, so {dp} data-parallel ranks) but "
            f"{cfg.deepspeed_source} says train_batch_size={total} = micro {micro} x accumulation {accum} x "
            f"{total // (micro * accum) if total % (micro * accum) == 0 else '?'} ranks. Make num_processes "
            f'match, or set train_batch_size to {micro * accum * dp} (or "auto").'
        )
    return world


def _positive_int(data: dict, key: str, path: Path, *, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value
