"""Lint existing DeepSpeed JSON and accelerate YAML files: the known traps, then DeepSpeed's and accelerate's own
config classes (so a file that passes here parses where it will run).

Each problem is a `LintFinding` (a `core.findings.Finding` named by its file); "error" findings would stop or
silently mis-train a run, "warning" ones waste memory. `config validate` exits by `core.findings.VALIDATE_EXIT`.
"""

from __future__ import annotations

import copy
import math
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from hf_dist_recipes.core.findings import ERROR, WARNING, Finding
from hf_dist_recipes.core.jsonfile import load_deepspeed_json, read_text_file
from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView
from hf_dist_recipes.parallel.plan_record import recorded_plan
from hf_dist_recipes.planning.initialize_rules import initialize_refusals
from hf_dist_recipes.planning.launch_config import LaunchConfig, check_launch_config, load_launch_config
from hf_dist_recipes.planning.launch_plan import is_loopback, plan_of_launch, unplanned
from hf_dist_recipes.planning.launch_script_check import check_launch_script, passes_rank0_address
from hf_dist_recipes.planning.launch_scripts import SCRIPT_SUFFIX, LaunchScript
from hf_dist_recipes.planning.sequence_parallel import sp_block_findings

# accelerate 1.16 (utils/dataclasses.py, DeepSpeedPlugin) refuses these YAML keys beside a deepspeed_config_file.
IGNORED_WITH_DS_FILE = (
    "mixed_precision",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)


@dataclass(frozen=True)
class LintFinding(Finding):
    """A finding in one file: `name` is the file's path, `detail` the message, which carries its fix (the table
    shows no separate fix line). `path` / `level` / `message` are the words of `config validate --json`."""

    @property
    def path(self) -> str:
        return self.name

    @property
    def level(self) -> str:
        return self.status

    @property
    def message(self) -> str:
        return self.detail

    def as_dict(self) -> dict:
        return {"path": self.path, "level": self.level, "message": self.message}


def lint_file(
    path: str | Path,
    *,
    root: str | Path | None = None,
    gpu_memory_gib: float | None = None,
    model: str | None = None,
    assume: dict | None = None,
    host_memory_gib: float | None = None,
    address_at_launch: bool = False,
) -> list[LintFinding]:
    """Findings for one file: `.json` is read as DeepSpeed config, `.yaml`/`.yml` as accelerate config (its
    DeepSpeed JSON is linted too, against the YAML's process count). With `gpu_memory_gib` (GiB per GPU) an
    accelerate config's plan is estimated (a DeepSpeed JSON's when it records the launch's plan, as config generate's
    do; another JSON gets a warning that it was not checked): an error when it does not fit, a warning above
    DEFAULT_DEVICE_TARGET of the GPU; with `host_memory_gib` (GiB per node) an error when its resume peak exceeds
    it; `model` names the model for files without a recorded plan; `assume` overrides the plan's `seq_len`,
    `micro_batch`, `activation_checkpointing` and `sp` for that estimate (None values: the files' or the defaults);
    `address_at_launch`: a YAML's launch is given the rank-0 address on its command line (`lint_files`). Unreadable
    files raise ValueError."""
    p = Path(path)
    if p.suffix == ".json":
        config = load_deepspeed_json(p)
        out = lint_deepspeed(config, str(p))
        if gpu_memory_gib is not None or host_memory_gib is not None:
            out += _json_memory_findings(p, config, gpu_memory_gib, model, assume, host_memory_gib)
        return out
    if p.suffix in (".yaml", ".yml"):
        return lint_accelerate(
            p,
            root=root,
            gpu_memory_gib=gpu_memory_gib,
            model=model,
            assume=assume,
            host_memory_gib=host_memory_gib,
            address_at_launch=address_at_launch,
        )
    if p.suffix == SCRIPT_SUFFIX:  # config generate --launcher's script, against its YAML's plan
        return [LintFinding(f.name, f.status, f"{f.detail}; {f.fix}") for f in check_launch_script(p)]
    raise ValueError(f"{p}: expected a DeepSpeed .json or an accelerate .yaml file, or a launch script (.sbatch)")


def lint_files(paths, **options) -> list[LintFinding]:
    """`lint_file` of each path (`options`: its keywords), as one launch's files: a YAML that a launch script among
    `paths` runs while passing the rank-0 address itself (the allocation's first node: the YAML's value is not used;
    the script's own check says whether it passes one) is linted with `address_at_launch`."""
    scripts = (p for p in paths if Path(p).suffix == SCRIPT_SUFFIX)
    covered = {yaml for yaml in map(passes_rank0_address, scripts) if yaml}
    return [f for path in paths for f in lint_file(path, address_at_launch=Path(path).resolve() in covered, **options)]


def check_readable(path: str | Path, *, root: str | Path | None = None) -> None:
    """Raise the ValueError `lint_file` would for a file it cannot read (missing, a directory, empty, not UTF-8, not
    JSON / YAML, another suffix), without linting or importing DeepSpeed: cheap, for refusing bad input first."""
    p = Path(path)
    if p.suffix == ".json":
        load_deepspeed_json(p)
    elif p.suffix in (".yaml", ".yml"):
        load_launch_config(p, root=root, given_as="FILE")
    elif p.suffix == SCRIPT_SUFFIX:
        text = read_text_file(p, "launch script", "pass a script written by config generate --launcher")
        LaunchScript.parse(text, str(p))
    else:
        raise ValueError(f"{p}: expected a DeepSpeed .json or an accelerate .yaml file, or a launch script (.sbatch)")


def lint_deepspeed(
    config: dict, name: str, *, world_size: int | None = None, use_cpu: bool | None = None
) -> list[LintFinding]:
    """Findings for a DeepSpeed config dict. `world_size` (all processes) enables the batch, EP and hpZ rules;
    `use_cpu` (the launch's) the device rules. Then what `deepspeed.initialize` would refuse
    (`initialize_rules`), then DeepSpeed's own config class."""
    out: list[LintFinding] = []

    def add(level, message):
        out.append(LintFinding(name, level, message))

    try:
        view = DeepSpeedView.read(config)
    except ValueError as err:
        add(ERROR, str(err))
        return out
    tp, tp_cfg = view.tp, view.tensor_parallel
    for message in view.ignored:
        add(WARNING, message)
    if tp > 1 and "train_batch_size" in config:
        add(
            ERROR,
            f"train_batch_size={config['train_batch_size']!r} with tensor_parallel.autotp_size={tp}: the "
            "Trainer fills it from the world size including TP ranks and DeepSpeed's batch check fails "
            "(DeepSpeed issue 7298); remove train_batch_size",
        )
    if isinstance(config.get("scheduler"), dict):
        # transformers 5.24 integrations/deepspeed.py deepspeed_optim_sched: a scheduler section wins over the
        # Trainer's lr_scheduler_type, so RecipeTrainer's warm-up + cosine with restarts would never run.
        add(
            WARNING,
            f"a scheduler section ({config['scheduler'].get('type', '?')}) replaces the recipe's linear "
            "warm-up + cosine with hard restarts without a word; remove it and set lr_scheduler_type / "
            "warmup_steps in the training arguments",
        )
    if tp > 1 and not tp_cfg.partition_config and not tp_cfg.preset_model:
        add(
            WARNING,
            "AutoTP without partition_config follows the model's own tp_plan, which DeepSpeed refuses for "
            "DeepSeek MLA/MoE models ('moe_tp_experts', 'packed_colwise'); write an explicit "
            "partition_config (hf-dist-recipes config generate does)",
        )
    if tp_cfg.preset_model in ("deepseek_v2", "deepseek_v3") and view.ep == 1:
        add(
            WARNING,
            f"tensor_parallel.preset_model={tp_cfg.preset_model!r} leaves the fused expert weights "
            "whole on every TP rank (measured 1.79x the per-rank model states of ZeRO-3 alone); add "
            "expert_parallel",
        )
    if view.ep_enabled and view.stage == 3 and view.zero.gather_16bit_weights_on_model_save:
        add(
            ERROR,
            "stage3_gather_16bit_weights_on_model_save with ZeRO-3 + AutoEP: DeepSpeed 0.19.8 refuses the "
            "consolidated save (NotImplementedError at the first checkpoint, in Trainer.save_model); set it "
            "to false. RecipeTrainer.save_model exports AutoEP models without it",
        )
    out += [
        LintFinding(name, r.level, r.message)
        for r in initialize_refusals(config, world_size=world_size, use_cpu=use_cpu)
    ]
    out += _deepspeed_own_checks(config, name, view, world_size)
    return out


def _deepspeed_own_checks(config: dict, name: str, view: DeepSpeedView, world_size: int | None) -> list[LintFinding]:
    """Parse through DeepSpeed's `DeepSpeedConfig` ("auto" filled with placeholders, as the Trainer fills it), then
    DeepSpeed's AutoEP validation for the launch's `world_size`, else the fewest processes TP x EP x ETP take."""
    from deepspeed.runtime.config import DeepSpeedConfig

    filled = _fill_autos(copy.deepcopy(config))
    # Outside a process group DeepSpeedConfig counts a world of 1; the batch arithmetic is checked elsewhere.
    filled.pop("train_batch_size", None)
    filled.setdefault("train_micro_batch_size_per_gpu", 1)
    try:
        DeepSpeedConfig(filled)
    except Exception as err:  # DeepSpeed raises pydantic, assertion and value errors alike
        return [LintFinding(name, ERROR, f"DeepSpeed refuses the config: {_first_line(err)}")]
    if not view.ep_enabled:
        return []
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config

    zero, etp = view.zero, view.expert_parallel.expert_tensor_parallel_size
    etp = etp if isinstance(etp, int) and etp > 0 else 1  # not an integer: DeepSpeed's own check below says so
    try:
        validate_autoep_config(
            view.expert_parallel,
            world_size or view.tp * view.ep * etp,
            1,
            view.tp,
            1,
            zero_stage=zero.stage,
            tp_preset_model=view.tensor_parallel.preset_model,
            # as the engine passes them: any offload section, "device": "none" too
            zero_offload_optimizer=zero.offload_optimizer is not None,
            zero_offload_param=zero.offload_param is not None,
        )
    except ValueError as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]  # DeepSpeed's raising line, as initialize_rules names them
        where = f"{Path(frame.filename).as_posix().rpartition('/deepspeed/')[2]}:{frame.lineno}"
        processes = f" for {world_size} processes" if world_size else ""
        return [LintFinding(name, ERROR, f"DeepSpeed AutoEP refuses it{processes}: {_first_line(err)} ({where})")]
    return []


def lint_accelerate(
    path: Path | LaunchConfig,
    *,
    root: str | Path | None = None,
    gpu_memory_gib: float | None = None,
    model: str | None = None,
    assume: dict | None = None,
    host_memory_gib: float | None = None,
    address_at_launch: bool = False,
) -> list[LintFinding]:
    """Findings for an accelerate YAML: accelerate's own loader, the launch consistency checks, the FSDP2 route's sizes,
    the Ulysses SP block of a DeepSpeed one (`sequence_parallel.sp_block_findings`), the rank-0 address of a
    multi-machine launch (not checked with `address_at_launch`: the launch passes one), the referenced DeepSpeed JSON
    and (with `gpu_memory_gib`) whether the plan fits the GPUs by our estimate.
    `path`: the YAML, or the `LaunchConfig` a caller already read (then `root` is not used)."""
    from accelerate.commands.config.config_args import load_config_from_file

    # A path is read here (ValueError for missing / malformed files); a caller that has read it hands it on.
    cfg = path if isinstance(path, LaunchConfig) else load_launch_config(path, root=root, given_as="FILE")
    name = str(cfg.path)
    out: list[LintFinding] = []
    try:
        load_config_from_file(name)
    except Exception as err:
        out.append(LintFinding(name, ERROR, f"accelerate refuses the config: {_first_line(err)}"))
    data = cfg.raw
    clashing = [k for k in IGNORED_WITH_DS_FILE if k in data or k in (data.get("deepspeed_config") or {})]
    if cfg.deepspeed_file is not None and clashing:
        out.append(
            LintFinding(
                name,
                ERROR,
                f"{', '.join(clashing)} set next to deepspeed_config_file: accelerate stops at "
                "launch ('will be ignored'); move them into the DeepSpeed JSON",
            )
        )
    try:
        world = check_launch_config(cfg)
    except ValueError as err:
        return out + [LintFinding(name, ERROR, str(err))]
    if cfg.num_machines > 1 and not address_at_launch and is_loopback(data.get("main_process_ip")):
        out.append(
            LintFinding(
                name,
                WARNING,
                f"main_process_ip is {data.get('main_process_ip')} on a "
                f"{cfg.num_machines}-machine launch: the other machines cannot reach a "
                "loopback address; set the rank-0 machine's address here or pass "
                "--main_process_ip at launch",
            )
        )
    if cfg.distributed_type == "FSDP":
        out += _lint_fsdp2(data, name, world)
    if cfg.deepspeed is not None:
        out += [LintFinding(name, *f) for f in sp_block_findings(data, world, cfg.deepspeed)]
        out += lint_deepspeed(cfg.deepspeed, cfg.deepspeed_source, world_size=world, use_cpu=cfg.use_cpu)
        out += _model_findings(cfg, world, model)
        checked = gpu_memory_gib is not None or host_memory_gib is not None
        out += [LintFinding(name, *f) for f in unplanned(cfg, world, memory_checked=checked)]
        if checked:
            out += _memory_findings(cfg, world, gpu_memory_gib, model, assume, host_memory_gib)
    return out


def _model_findings(cfg, world: int, model_ref: str | None) -> list[LintFinding]:
    """The launch's TP and EP against the model (heads, experts, layers: `ParallelPlan.validate`): `model_ref`, else
    the model the DeepSpeed JSON records. A file with neither says the plan was not checked against a model."""
    from hf_dist_recipes.planning.models import introspect

    name = str(cfg.deepspeed_file or cfg.path)
    plan, recorded = plan_of_launch(cfg, world)
    ref = model_ref or recorded
    if not ref:
        if plan.tp == 1 and plan.ep == 1:
            return []  # nothing model-dependent to check
        return [
            LintFinding(
                name,
                WARNING,
                f"TP {plan.tp} / EP {plan.ep} were not checked against a model: the JSON records none (config "
                "generate records its --model); pass --model to check heads and experts divide",
            )
        ]
    out = []
    if model_ref and recorded and model_ref != recorded:
        out.append(LintFinding(name, WARNING, f"generated for {recorded}; checked against --model {model_ref}"))
    try:
        warnings = plan.validate(introspect(ref))
    except ValueError as err:
        return out + [LintFinding(name, ERROR, f"{ref}: {err}")]
    return out + [LintFinding(name, WARNING, f"{ref}: {w}") for w in warnings]


def _json_memory_findings(
    p: Path,
    config: dict,
    gpu_memory_gib: float | None,
    model_ref: str | None,
    assume: dict | None,
    host_memory_gib: float | None,
) -> list[LintFinding]:
    """The memory check of a DeepSpeed JSON named alone. How many processes and machines share the model is the
    launch's (the accelerate YAML's), not the JSON's: a JSON that `config generate` wrote records them with its plan,
    and is checked as that launch; any other is said to be unchecked, naming the file that would answer, rather
    than passing in silence."""
    record = recorded_plan(config)
    nodes, per_node = record.get("nodes"), record.get("procs_per_node")
    if not (isinstance(nodes, int) and isinstance(per_node, int) and nodes > 0 and per_node > 0):
        return [
            LintFinding(
                str(p),
                WARNING,
                "memory not checked against --gpu-memory / --host-memory: a DeepSpeed JSON alone does not say how "
                "many processes and machines share the model; validate the accelerate YAML that names it (config "
                "generate writes both, and its JSON records the plan)",
            )
        ]
    launch = LaunchConfig(
        path=p,
        distributed_type="DEEPSPEED",
        num_processes=nodes * per_node,
        num_machines=nodes,
        use_cpu=gpu_memory_gib is None and record.get("precision") == "fp32",
        deepspeed_file=p,
        deepspeed=config,
    )
    return _memory_findings(launch, nodes * per_node, gpu_memory_gib, model_ref, assume, host_memory_gib)


def _memory_findings(
    cfg,
    world: int,
    gpu_memory_gib: float | None,
    model_ref: str | None,
    assume: dict | None = None,
    host_memory_gib: float | None = None,
) -> list[LintFinding]:
    from hf_dist_recipes.planning.fit import FLAGS, SOURCES, check_fit
    from hf_dist_recipes.planning.memory import DEFAULT_DEVICE_TARGET
    from hf_dist_recipes.planning.models import introspect

    name = str(cfg.path)
    plan, recorded_model = plan_of_launch(cfg, world)
    model_ref = model_ref or recorded_model
    if not model_ref:
        return [
            LintFinding(
                name,
                WARNING,
                "no model is recorded in the DeepSpeed JSON (config generate records the "
                "--model it was given): pass --model to check memory against --gpu-memory / --host-memory",
            )
        ]
    # Where each activation-side value came from, so that the verdict can say it (plan_of_launch's order).
    sources = {k: "recorded by config generate" for k in recorded_plan(cfg.deepspeed) if k in SOURCES}
    if cfg.view.micro_batch is not None:
        sources["micro_batch"] = "the DeepSpeed JSON"
    sources = {k: sources.get(k, "default, not in the files") for k in SOURCES}
    given = {k: v for k, v in (assume or {}).items() if v is not None}
    plan = replace(plan, **given)
    sources.update({k: FLAGS[k] for k in given})
    shape = introspect(model_ref)
    gpu_source = "--gpu-memory" if gpu_memory_gib is not None else "no GPU limit given"
    if gpu_memory_gib is None:  # the host alone: the device side is not asked about
        gpu_memory_gib = math.inf
    verdict = check_fit(plan, shape, model_ref, gpu_memory_gib, gpu_source, sources, host_gib=host_memory_gib)
    change = "validate takes --seq-len, --micro-batch and --activation-checkpointing / --no-activation-checkpointing"
    if not verdict.fits:
        # An error: asked whether the plan fits --gpu-memory / --host-memory, the answer "no" is a job that stops
        # out of memory at its first step or its first resume (validate exits 1), not a matter of taste.
        return [LintFinding(name, ERROR, verdict.message(change=change))]
    tight = replace(verdict, device_target=DEFAULT_DEVICE_TARGET)
    if gpu_source == "--gpu-memory" and not tight.device_fits:
        return [LintFinding(name, WARNING, tight.message(change=change) + " (it fits the whole GPU: no headroom)")]
    return []


def _lint_fsdp2(data: dict, name: str, world: int) -> list[LintFinding]:
    pc = data.get("parallelism_config") or {}
    if not pc:
        return []
    sizes = {k: int(pc.get(f"parallelism_config_{k}_size", 1)) for k in ("dp_replicate", "dp_shard", "tp", "cp")}
    out = []
    product = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"] * sizes["cp"]
    if product != world:
        out.append(
            LintFinding(
                name,
                ERROR,
                f"parallelism_config sizes multiply to {product} ({sizes}) but num_processes "
                f"is {world}; make dp_replicate x dp_shard x tp x cp equal num_processes",
            )
        )
    if data.get("use_cpu"):
        out.append(
            LintFinding(
                name,
                ERROR,
                "use_cpu with parallelism_config: accelerate refuses ParallelismConfig on "
                "MULTI_CPU; this route runs on GPUs only",
            )
        )
    if (data.get("fsdp_config") or {}).get("fsdp_version") != 2:
        out.append(LintFinding(name, ERROR, "parallelism_config needs fsdp_config.fsdp_version: 2"))
    return out


_AUTO_PLACEHOLDERS = {"enabled": False, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _fill_autos(node, key: str | None = None):
    if isinstance(node, dict):
        return {k: _fill_autos(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_autos(v) for v in node]
    return _AUTO_PLACEHOLDERS.get(key, 1) if node == "auto" else node


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return " ".join(line.strip() for line in text[:3] if line.strip()) or type(err).__name__
