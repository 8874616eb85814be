"""Plan, check and run the demo: `accelerate launch` over `hf_dist_recipes.demo.train` with a shipped config.

`plan_demo` builds everything (config choice, world size, backend, command) and checks it without launching;
`run_demo` launches the plan and reads back the per-rank summaries.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import hf_dist_recipes
from hf_dist_recipes.comm import backend
from hf_dist_recipes.core.launch import Launch, run_launch
from hf_dist_recipes.core.user_values import positive_int, writable_dir
from hf_dist_recipes.demo.settings import DemoSettings, check_settings, max_bytes_for
from hf_dist_recipes.doctor.op_builds import check_no_stale_locks
from hf_dist_recipes.logs.summary import SUMMARY_DIRNAME, RunSummary, read_rank_summaries, summarize_ranks
from hf_dist_recipes.planning.launch_config import check_launch_config, load_launch_config

CPU_CONFIG = "cpu_zero3_2proc.yaml"  # shipped configs (planning.shipped), generated from their manifest
GPU_CONFIG = "zero3_1node_8gpu.yaml"


def default_config(name: str) -> tuple[Path, Path]:
    """(YAML, launch directory) of shipped config `name`. In a source checkout, accelerate_configs/NAME with the
    checkout's root (the YAML's relative DeepSpeed path resolves there); from an installed package, a copy whose
    DeepSpeed path is absolute (`planning.shipped.config_path`), launched from the current directory."""
    from hf_dist_recipes.planning.shipped import SHIPPED_PREFIX, config_path

    checkout = Path(hf_dist_recipes.__file__).resolve().parents[1]
    if (checkout / SHIPPED_PREFIX / name).is_file():
        return checkout / SHIPPED_PREFIX / name, checkout
    return config_path(name), Path.cwd()


@dataclass(frozen=True)
class DemoPlan:
    """A checked demo launch. `device` is "cuda" or "cpu"; `backend` the collective backend the ranks will use."""

    config_file: Path
    deepspeed_file: Path | None
    num_processes: int
    device: str
    backend: str
    cwd: Path
    settings: DemoSettings
    launch: Launch

    @property
    def command(self) -> list[str]:
        return self.launch.argv()

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "launch"}
        for key in ("config_file", "deepspeed_file", "cwd"):
            out[key] = str(out[key]) if out[key] is not None else None
        out["settings"] = asdict(self.settings)
        out["command"] = self.command
        return out


def plan_demo(
    settings: DemoSettings,
    *,
    config_file: str | Path | None = None,
    num_processes: int | None = None,
    cuda_devices: int | None = None,
) -> DemoPlan:
    """Choose and check the launch. On a CUDA host the GPU config with one process per GPU (NCCL); otherwise the
    CPU config (2 processes, Gloo). Raises ValueError, naming the fix, for any inconsistency."""
    if num_processes is not None:
        positive_int(num_processes, "--num-processes", 2, unit="processes")
    gpus = backend.cuda_device_count() if cuda_devices is None else cuda_devices
    root = Path.cwd()
    if config_file is None:
        config_file, root = default_config(GPU_CONFIG if gpus else CPU_CONFIG)
        if gpus and num_processes is None:
            num_processes = gpus
    cfg = load_launch_config(config_file, root=root)
    world = cfg.num_processes if num_processes is None else num_processes
    # Every setting before anything slow or anything launched: a bad value is one line here, not a traceback per rank
    # (and before the DeepSpeed JSON is read, whose reader imports DeepSpeed and its notice).
    check_settings(settings, world)
    settings = replace(settings, max_bytes=max_bytes_for(settings, world))  # the ranks get the resolved value
    output_dir = writable_dir(settings.output_dir, "--output", "runs/demo")
    check_launch_config(cfg, num_processes=num_processes)
    if cfg.deepspeed is not None:
        check_no_stale_locks()
    requested = settings.backend or (backend.CPU_BACKEND if cfg.use_cpu else None)
    comm = backend.resolve_backend(requested, allow_gloo_on_cuda=settings.allow_gloo_on_cuda, cuda_devices=gpus)
    device = "cpu" if (cfg.use_cpu or not gpus) else "cuda"
    settings = replace(settings, output_dir=str(output_dir))
    if settings.data_files:
        settings = replace(settings, data_files=tuple(check_user_data(settings)))
    launch = Launch(
        module="hf_dist_recipes.demo.train",
        args=tuple(settings_to_flags(settings)),
        config_file=Path(config_file).resolve(),
        num_processes=world,
        cwd=root,
        # Without a CUDA device DeepSpeed 0.19 picks its CPU accelerator by itself, and says so in every process
        # (launcher and ranks: "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
        # detect it."). Naming the CPU keeps its choice and drops the guess; a DS_ACCELERATOR of the user's wins.
        env_defaults={} if gpus else {"DS_ACCELERATOR": "cpu"},
    )
    return DemoPlan(
        config_file=Path(config_file).resolve(),
        deepspeed_file=cfg.deepspeed_file,
        num_processes=world,
        device=device,
        backend=comm,
        cwd=root,
        settings=settings,
        launch=launch,
    )


def check_user_data(settings: DemoSettings) -> list[str]:
    """The absolute paths of `settings.data_files` (the ranks run in another directory), after building their byte
    blocks once here: a file that gives no training data fails now, in one line, not on every rank after the
    launch; and the ranks then load the blocks from datasets' cache."""
    from hf_dist_recipes.demo.data import check_data_files, quiet_datasets, text_files_dataset

    _, files = check_data_files(settings.data_files)  # before importing datasets (a second): a missing file is quick
    with quiet_datasets():  # the CLI's own output stays the plan, or the one-line error
        text_files_dataset(files, seq_len=settings.seq_len, text_field=settings.text_field)
    return files


def settings_to_flags(s: DemoSettings) -> list[str]:
    """The train script's flags for `s` (inverse of `demo.train.settings_from`)."""
    flags = [
        "--output-dir",
        s.output_dir,
        "--max-steps",
        str(s.max_steps),
        "--seq-len",
        str(s.seq_len),
        "--micro-batch",
        str(s.micro_batch),
        "--learning-rate",
        str(s.learning_rate),
        "--warmup-steps",
        str(s.warmup_steps),
        "--logging-steps",
        str(s.logging_steps),
        "--max-bytes",
        str(s.max_bytes),
        "--seed",
        str(s.seed),
    ]
    if s.data_files:
        flags += ["--data-files", *s.data_files, "--text-field", s.text_field]
    if s.backend:
        flags += ["--backend", s.backend]
    if s.allow_gloo_on_cuda:
        flags.append("--allow-gloo-on-cuda")
    if not s.save_final:
        flags.append("--no-save")
    return flags


@dataclass(frozen=True)
class DemoResult:
    """What a finished demo run measured. `wall_seconds` covers the whole launch (process start, DeepSpeed op
    build on a first run, training, saving)."""

    plan: DemoPlan
    returncode: int
    wall_seconds: float
    summary: RunSummary | None

    @property
    def loss_fell(self) -> bool:
        s = self.summary
        return bool(s and s.first_loss is not None and s.last_loss is not None and s.last_loss < s.first_loss)

    def as_dict(self) -> dict:
        return {
            "plan": self.plan.as_dict(),
            "returncode": self.returncode,
            "wall_seconds": self.wall_seconds,
            "loss_fell": self.loss_fell,
            "summary": self.summary.as_dict() if self.summary else None,
            "model_dir": os.path.join(self.plan.settings.output_dir, "final")
            if self.plan.settings.save_final
            else None,
        }


def run_demo(plan: DemoPlan, *, quiet: bool = False) -> DemoResult:
    """Launch `plan` and wait. The ranks' output (progress bar included) goes to this terminal unless `quiet`; a
    Ctrl-C ends every process of the launch (`core.launch.kill_tree`), then is raised again."""
    # Summaries left by an earlier run in the same directory must not pass for this run's, and the demo is a new job
    # each time: its TensorBoard runs start over (RecipeTrainer refuses to mix a new launch into old rank<N> runs).
    shutil.rmtree(Path(plan.settings.output_dir) / SUMMARY_DIRNAME, ignore_errors=True)
    shutil.rmtree(Path(plan.settings.output_dir) / "tensorboard", ignore_errors=True)
    launched = run_launch(plan.launch, output="discard" if quiet else "inherit")
    rows = read_rank_summaries(plan.settings.output_dir)
    summary = summarize_ranks(rows) if rows and launched.returncode == 0 else None
    return DemoResult(plan=plan, returncode=launched.returncode, wall_seconds=launched.seconds, summary=summary)
