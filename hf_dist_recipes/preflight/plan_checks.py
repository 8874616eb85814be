"""Preflight check 4, plan: the launch config's plan against the model, and its memory per rank against the device.

Two halves, so that a plan that cannot work never reaches `accelerate launch`:
- `launch_plan` + `resolve_models` run in the CLI before launching (one line, exit 2, for a TP that does not divide
  the processes, an EP that does not divide the experts, an unreadable config);
- `check_plan` runs on the launched ranks, which know their device: GPU memory (`torch.cuda` of the rank's device),
  or on CPU the host's RAM shared by the node's processes.

The model: `--model` (a template of `core.model_templates.TEMPLATES` or a local config.json / its directory), else the
model recorded in the DeepSpeed JSON by `config generate`, else the demo's DeepSeek-V3-style model
(`demo-deepseek-v3`). The plan check validates and estimates that model as named, whatever its size. The training
checks (5 and 6) need a model that trains in seconds, so they get a *stand-in*: the named model itself when it has
at most STAND_IN_MAX_PARAMS parameters, else a tiny model of the same family (DeepSeek-V2/V3: the demo's model;
Llama/Qwen2: `tiny-llama`; other families: the model's own config shrunk), with attention heads, experts and the
TP-split widths rounded up to multiples of TP and EP so the real plan applies to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_dist_recipes.core.sizes import GIB, format_size
from hf_dist_recipes.planning.launch_config import LaunchConfig, check_launch_config, load_launch_config
from hf_dist_recipes.planning.launch_plan import plan_of_launch
from hf_dist_recipes.planning.memory import DEFAULT_DEVICE_TARGET
from hf_dist_recipes.planning.plan import ParallelPlan
from hf_dist_recipes.preflight.result import ERROR, OK, WARNING, CheckResult

DEFAULT_MODEL = "demo-deepseek-v3"  # the demo's model: MLA + MoE, what the shipped CPU configs train
STAND_IN_MAX_PARAMS = 20_000_000  # a named model up to this size trains as itself in the training checks
WARN_FRACTION = DEFAULT_DEVICE_TARGET  # an estimate above this fraction of the device is a warning, above 1 an error


def launch_plan(
    config: LaunchConfig | str | Path, *, root: str | Path | None = None
) -> tuple[LaunchConfig, ParallelPlan, str | None]:
    """(launch config, its plan, the model it records or None) of an accelerate YAML and its DeepSpeed JSON: a path
    is read once (`load_launch_config`, relative DeepSpeed paths against `root`), a `LaunchConfig` already read is
    used as it is; hand the returned one on rather than reading the files again. Raises ValueError naming the fix
    when the files are unreadable, disagree, or the plan cannot run on the launch's processes (TP or EP not
    dividing them, offload rules); nothing is imported beyond the parsers."""
    cfg = config if isinstance(config, LaunchConfig) else load_launch_config(config, root=root)
    world = check_launch_config(cfg)
    plan, recorded = plan_of_launch(cfg, world)
    try:
        plan.validate(deepspeed_version=None)
    except ValueError as err:
        raise ValueError(f"{cfg.path}: {err}") from None
    return cfg, plan, recorded


@dataclass(frozen=True)
class PlanModels:
    """The model the plan is checked against (`name`, `config`, `source`: "--model", "recorded in <json>" or
    "default") and the one the training checks train (`train_name`, `train_config`)."""

    name: str
    config: object
    source: str
    train_name: str
    train_config: object


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _heads(base: int, tp: int) -> int:
    return _round_up(base, tp)


def stand_in_config(plan: ParallelPlan, model_type: str | None = None, base_config=None):
    """(name, config) of a tiny model of `model_type`'s family (None: DeepSeek-V3) on which `plan` runs: heads a
    multiple of TP, routed experts a multiple of EP, vocabulary and MLP widths multiples of TP."""
    from hf_dist_recipes.core.model_templates import TEMPLATES, template_config
    from hf_dist_recipes.planning.models import DEEPSEEK_TYPES

    tp, ep = plan.tp, plan.ep
    if model_type is None or model_type in DEEPSEEK_TYPES:
        values = TEMPLATES[DEFAULT_MODEL][1]
        experts = _round_up(values["n_routed_experts"], ep)
        wanted = dict(
            num_attention_heads=_heads(values["num_attention_heads"], tp),
            num_key_value_heads=_heads(values["num_key_value_heads"], tp),
            n_routed_experts=experts,
            vocab_size=_round_up(values["vocab_size"], tp),
            intermediate_size=_round_up(values["intermediate_size"], tp),
            moe_intermediate_size=_round_up(values["moe_intermediate_size"], tp),
        )
        if experts % values["n_group"]:  # DeepSeek's group-limited routing needs groups dividing the experts
            wanted.update(n_group=1, topk_group=1)
        changed = {k: v for k, v in wanted.items() if values.get(k) != v}
        name = DEFAULT_MODEL + (f" (sized for TP {tp}, EP {ep})" if changed else "")
        return name, template_config(DEFAULT_MODEL, **changed)
    if model_type in ("llama", "qwen2"):
        values = TEMPLATES["tiny-llama"][1]
        heads = _heads(values["num_attention_heads"], tp)
        changed = {
            k: v
            for k, v in dict(
                num_attention_heads=heads,
                num_key_value_heads=heads,
                vocab_size=_round_up(values["vocab_size"], tp),
                intermediate_size=_round_up(values["intermediate_size"], tp),
            ).items()
            if values.get(k) != v
        }
        return "tiny-llama" + (f" (sized for TP {tp})" if changed else ""), template_config("tiny-llama", **changed)
    from transformers import AutoConfig

    heads = _heads(4, tp)
    experts = _round_up(8, ep)
    small = dict(
        hidden_size=64,
        intermediate_size=_round_up(128, tp),
        moe_intermediate_size=_round_up(32, tp),
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=16,
        vocab_size=_round_up(256, tp),
        max_position_embeddings=512,
        num_experts_per_tok=2,
        use_cache=False,
    )
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if base_config is not None and getattr(base_config, key, None):
            small[key] = experts
    return f"tiny {model_type}", AutoConfig.for_model(model_type, **small)


def resolve_models(plan: ParallelPlan, model: str | None, recorded: str | None, *, deepspeed_file=None) -> PlanModels:
    """The models of the module docstring. Raises ValueError (from `planning.models`) for an unknown --model."""
    from hf_dist_recipes.planning.models import introspect, load_model_config

    if model:
        source = "--model"
    elif recorded:
        model, source = recorded, f"recorded in {deepspeed_file}" if deepspeed_file else "recorded"
    else:
        model, source = DEFAULT_MODEL, "default"
    name, config = load_model_config(model)
    if source == "default":
        name, config = stand_in_config(plan)
    small = introspect(config).total_params <= STAND_IN_MAX_PARAMS
    train_name, train_config = (name, config) if small else stand_in_config(plan, config.model_type, config)
    return PlanModels(name=name, config=config, source=source, train_name=train_name, train_config=train_config)


def validate_against_model(plan: ParallelPlan, models: PlanModels) -> list[str]:
    """`plan.validate` with the named model and, when it differs, the stand-in; ValueError for the first rule
    broken (naming the model), warnings otherwise."""
    from hf_dist_recipes.planning.models import introspect

    warnings = plan.validate(introspect(models.config))
    if models.train_config is not models.config:
        try:
            plan.validate(introspect(models.train_config))
        except ValueError as err:
            raise ValueError(f"the training checks' stand-in {models.train_name}: {err}") from None
    return warnings


def device_memory_bytes(device: str, procs_per_node: int) -> tuple[int | None, str]:
    """(bytes one rank may use, what they are) on this process: its GPU's total memory when `device` is "cuda",
    else the host's memory (`host_memory_bytes`) divided by the node's `procs_per_node` processes. None when it
    cannot be read."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            return int(props.total_memory), f"GPU {index} ({props.name})"
        return None, "no CUDA device visible"
    total, what = host_memory_bytes()
    if total is None:
        return None, what
    return total // max(1, procs_per_node), f"{what} / {procs_per_node} process(es) per node"


def host_memory_bytes() -> tuple[int | None, str]:
    """(bytes the node's ranks may hold together, where the figure comes from): MemTotal, or the cgroup's limit
    when smaller (`doctor.host_memory`)."""
    from hf_dist_recipes.doctor.host_memory import host_memory

    facts = host_memory()
    if facts.usable is None:
        return None, "host memory unreadable (no /proc/meminfo)"
    return facts.usable, f"host memory ({facts.describe()})"


def host_result(plan: ParallelPlan, est, host_bytes: int | None, host_what: str, model_name: str):
    """Check 4's host finding for a GPU plan: its host memory per node (offloaded states and the ranks' processes,
    `planning.memory`) against `host_bytes`, the smallest node's: an error when training does not fit, a warning
    when only the stock Trainer's resume (`est.stock_resume_peak_per_node`: DeepSpeed's plain load of the optimizer
    files) does not;
    RecipeTrainer's memory-mapped resume stays at the steady state. None for CPU plans (the device check is the
    host's) or when the host could not be read."""
    if plan.device != "cuda" or host_bytes is None:
        return None
    steady, stock_peak = est.host_steady_per_node, est.stock_resume_peak_per_node
    detail = (
        f"{model_name}: {steady / GIB:,.0f} GiB of host memory per node while training and at a RecipeTrainer "
        f"resume, {stock_peak / GIB:,.0f} GiB at a stock Trainer's resume, by our estimate; {host_bytes / GIB:,.0f} "
        f"GiB per node ({host_what}, the smallest node's)"
    )
    data = {"host_steady_bytes": steady, "host_stock_resume_peak_bytes": stock_peak, "host_bytes": host_bytes}
    fix = (
        "ask the scheduler for the whole node's memory (sbatch --mem=0), offload less (more nodes, or no parameter "
        "offload), or find a plan with hf-dist-recipes config estimate --suggest --host-memory "
        f"{host_bytes / GIB:.0f}"
    )
    if steady > host_bytes:
        return CheckResult("plan", ERROR, detail + ": training does not fit", fix=fix, data=data)
    if stock_peak > host_bytes:
        return CheckResult(
            "plan",
            WARNING,
            detail + ": a stock Trainer's resume does not fit",
            fix="resume with RecipeTrainer (memory_mapped_resume=True, its default), or " + fix,
            data=data,
        )
    return CheckResult("plan", OK, detail, data=data)


def check_plan(
    plan: ParallelPlan,
    models: PlanModels,
    *,
    device_bytes: int | None,
    device_what: str,
    host_bytes: int | None = None,
    host_what: str = "",
) -> list[CheckResult]:
    """Check 4's findings: the plan against the model (error for a rule broken, warning per plan warning), the
    per-rank memory estimate against `device_bytes` (the smallest any rank has; None: not known, a warning), and
    a GPU plan's host memory per node against `host_bytes` (the smallest node's; `host_result`)."""
    from hf_dist_recipes.planning.memory import estimate
    from hf_dist_recipes.planning.models import introspect

    what = (
        f"ZeRO-{plan.zero_stage}, TP {plan.tp}, EP {plan.ep}, {plan.world_size} process(es), seq "
        f"{plan.seq_len}, micro batch {plan.micro_batch}, {plan.precision}, "
        # the activations depend on recomputation as much as on the sequence: a verdict names which it assumed
        + ("activation checkpointing" if plan.activation_checkpointing else "no recomputation")
    )
    out: list[CheckResult] = []
    try:
        warnings = validate_against_model(plan, models)
    except ValueError as err:
        return [
            CheckResult(
                "plan",
                ERROR,
                f"{models.name} ({models.source}) with {what}: {err}",
                fix="change the degrees in the launch config (hf-dist-recipes config generate --model "
                f"{models.name.split(' ')[0]} writes one that fits), or pass the intended --model",
            )
        ]
    for w in warnings:
        out.append(CheckResult("plan", WARNING, f"{models.name}: {w}", fix=w.split("; ")[-1]))
    est = estimate(plan, introspect(models.config))
    need = est.device_total
    host = host_result(plan, est, host_bytes, host_what, models.name)
    out += [host] if host else []
    data = {
        "model": models.name,
        "model_source": models.source,
        "train_model": models.train_name,
        "plan": plan.as_dict(),
        "estimate_bytes": need,
        "device_bytes": device_bytes,
        "device": device_what,
    }
    if device_bytes is None:
        out.append(
            CheckResult(
                "plan",
                WARNING,
                f"{models.name} with {what}: {need / GIB:.2f} GiB per rank by our "
                f"estimate; the device memory could not be read ({device_what})",
                fix="check the ranks see their devices (hf-dist-recipes doctor)",
                data=data,
            )
        )
        return out
    share = need / device_bytes
    detail = (
        f"{models.name} ({models.source}) with {what}: {need / GIB:.2f} GiB per rank by our estimate, "
        f"{share:.0%} of {device_bytes / GIB:.1f} GiB ({device_what}, the smallest of the ranks)"
    )
    if models.train_name != models.name:
        detail += f"; the training checks train {models.train_name}"
    suggest = (
        f"hf-dist-recipes config estimate --model {models.name.split(' ')[0]} --nodes {plan.nodes} "
        f"--gpus-per-node {plan.procs_per_node} --suggest finds a plan that fits"
    )
    if share > 1:
        out.append(CheckResult("plan", ERROR, detail + ": it does not fit", fix=suggest, data=data))
    elif share > WARN_FRACTION:
        out.append(
            CheckResult(
                "plan", WARNING, detail + ": little headroom for what the estimate leaves out", fix=suggest, data=data
            )
        )
    else:
        out.append(CheckResult("plan", OK, detail, data=data))
    return out


SAVES_TO_HOLD = 2  # a save must never meet a full disk: room for the next checkpoint beside the last one


def checkpoint_space_result(plan: ParallelPlan, model_shape, free_bytes: int, where: str) -> CheckResult:
    """Check 4's disk finding: warn when `free_bytes` (free space of the output directory's file system, `where`)
    holds fewer than SAVES_TO_HOLD checkpoints of `plan` (`parallel.checkpoint_bytes`: the engine's files of every
    rank, with the output directory shared by all nodes, as a parallel file system is)."""
    from hf_dist_recipes.planning.elements import plan_save_bytes

    b = plan_save_bytes(plan, model_shape)
    per_save = b.checkpoint_total()
    sizes = (free_bytes, per_save, b.checkpoint_per_rank(), b.hf_total)
    free, save, rank, hf = (format_size(n, decimal=True) for n in sizes)  # decimal units, as the shard sizes
    detail = (
        f"{where}: {free} free; one checkpoint of this plan is {save} ({rank} per rank x {plan.world_size}), the "
        f"final save_model {hf}"
    )
    data = {"free_bytes": free_bytes, "where": where, "save_bytes": b.as_dict()}
    if free_bytes < SAVES_TO_HOLD * per_save:
        return CheckResult(
            "plan",
            WARNING,
            detail + f": fewer than {SAVES_TO_HOLD} checkpoints fit",
            fix="free space, point output_dir at a larger file system, or keep fewer checkpoints "
            "(save_total_limit); with node-local disks each node needs its ranks' share only",
            data=data,
        )
    return CheckResult("plan", OK, detail + f": {free_bytes // max(1, per_save)} checkpoints fit", data=data)


def check_checkpoint_space(plan: ParallelPlan, models: PlanModels, output_dir: str | Path) -> CheckResult:
    """`checkpoint_space_result` for the file system of `output_dir` (its nearest existing parent)."""
    import shutil

    from hf_dist_recipes.planning.models import introspect

    path = Path(output_dir).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return checkpoint_space_result(plan, introspect(models.config), shutil.disk_usage(path).free, str(path))
