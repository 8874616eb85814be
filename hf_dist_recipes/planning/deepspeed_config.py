"""DeepSpeed JSON for a ParallelPlan.

What it never writes: `train_batch_size` (trap 1: under AutoTP DeepSpeed derives it from the micro batch, the
accumulation and its own data-parallel group; the Trainer's fill would count TP ranks). What it always writes for
TP > 1: an explicit `tensor_parallel.partition_config` (trap 2: stock AutoTP refuses DeepSeek's tp_plan), and no
TP preset, so the TP and EP presets cannot disagree (trap 3). Under ZeRO-3 + EP:
`stage3_gather_16bit_weights_on_model_save: false`, because DeepSpeed refuses the consolidated save there.
What the Trainer fills from its `TrainingArguments` is `"auto"` (transformers' `HfTrainerDeepSpeedConfig.
trainer_config_process` fills an "auto" and refuses an explicit value that differs from the arguments):
`train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, `gradient_clipping`; no optimizer or scheduler
section, so the learning rate, betas, epsilon, weight decay and schedule are the arguments' alone. The micro batch and
accumulation the plan was sized for stay in the record, where `config validate` and the ranks read them
(`parallel.plan_record`: rank 0 warns when the arguments' micro batch exceeds it). bf16/fp16 are the plan's
precision unless `auto` (the Trainer then refuses arguments that disagree: the precision is part of the estimate).
Always: gradients accumulate in fp32 (`data_types.grad_accum_dtype`, see `environment.precision`) and are
reduced across ranks in `plan.grad_reduce_dtype` (`communication_data_type`, fp32 by default; DeepSpeed's own
default is the compute dtype: engine.py `communication_data_type`), and the
plan the file was generated for is recorded under `"hf_dist_recipes"` (`plan_record`). Under ZeRO-3 with a model:
prefetch, live-parameter, reduce and sub-group sizes, ZeRO++ hpZ where it pays, and the vocabulary-parallel LM
head where it pays, all from `zero_buffers` (which the memory estimate reads too; `zero_buffer_notes` says why).
With Ulysses SP (`plan.sp` > 1): `seq_parallel_communication_data_type` (what DeepSpeed reduces in under SP) and
`reduce_scatter: true` written out; the SP block itself is the accelerate YAML's (`accelerate_config`).
"""

from __future__ import annotations

from dataclasses import replace

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.parallel.checkpoint_bytes import startup_timeout_s
from hf_dist_recipes.parallel.plan_record import PLAN_KEY, RECORDED, RECORDED_ABOVE_ONE, RECORDED_WHEN_SET
from hf_dist_recipes.planning.elements import plan_save_bytes
from hf_dist_recipes.planning.launch_scripts import planned_signal_lead
from hf_dist_recipes.planning.memory import estimate
from hf_dist_recipes.planning.models import ModelShape
from hf_dist_recipes.planning.plan import EP_PRESETS, ParallelPlan
from hf_dist_recipes.planning.tp_specs import partition_config
from hf_dist_recipes.planning.zero_buffers import zero_buffers


def plan_record(plan: ParallelPlan, model_name: str | None, model: ModelShape | None = None) -> dict:
    """The section written into a generated DeepSpeed JSON under `PLAN_KEY`, read back in each rank by
    `parallel.plan_record.recorded_plan`."""
    record = {
        "model": model_name,
        **{k: getattr(plan, k) for k in RECORDED},
        **{k: getattr(plan, k) for k in RECORDED_WHEN_SET if getattr(plan, k) is not None},
        **{k: getattr(plan, k) for k in RECORDED_ABOVE_ONE if getattr(plan, k) > 1},
    }
    if model is not None:  # the collective timeout start-up needs while rank 0 reads the weights
        record["startup_timeout_s"] = startup_timeout_s(plan_save_bytes(plan, model).hf_total)
    if model is not None and plan.device == "cuda":  # what `config validate` holds a launch script's --signal to
        record["signal_lead_s"] = planned_signal_lead(plan, model)[0]
    if model is not None and plan.activation_checkpointing:  # what a rank that will not recompute quotes
        record["device_gib"] = round(estimate(plan, model).device_total / GIB, 1)
        no_recompute = replace(plan, activation_checkpointing=False)
        record["device_gib_no_recompute"] = round(estimate(no_recompute, model).device_total / GIB, 1)
    return {
        "generated_for": record,
        "note": "written by hf-dist-recipes config generate; read by RecipeTrainingArguments; DeepSpeed ignores it",
    }


def deepspeed_config(
    plan: ParallelPlan, model: ModelShape | None = None, *, auto: bool = False, model_ref: str | None = None
) -> dict:
    """The DeepSpeed config dict for `plan`. `model` is needed when TP > 1 or EP > 1 (layer specs, EP preset).
    Micro batch, accumulation and clipping are always "auto" (the plan's micro batch and accumulation are in the
    record); `auto` writes "auto" for bf16/fp16 too, otherwise the plan's precision, which the Trainer checks
    against its arguments. `model_ref`: how the model was named (a template or a config path),
    recorded so that `config validate` can estimate the plan again; default the model's name."""
    zero: dict = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        # Overlapping reduction with backward pays on GPUs; on CPU/Gloo it only adds threads fighting for cores.
        zero["overlap_comm"] = plan.device == "cuda"
        zero["contiguous_gradients"] = True
    if plan.sp > 1 and plan.zero_stage >= 1:
        # Written out, DeepSpeed's default: transformers refuses SP + ZeRO-3 with reduce_scatter false next to
        # contiguous_gradients on deepspeed < 0.20.2 (trainer.py:1823-1843: some gradients stay scaled by sp).
        zero["reduce_scatter"] = True
    if plan.zero_stage == 3:
        # DeepSpeed 0.19.8 refuses the consolidated 16-bit save under AutoEP (the stock Trainer's save_model then
        # stops at the first checkpoint); false makes the stock Trainer fall back to engine.save_checkpoint.
        # RecipeTrainer.save_model streams its own export in every layout and ignores the flag.
        zero["stage3_gather_16bit_weights_on_model_save"] = plan.ep == 1
    buffers = zero_buffers(plan, model)
    if buffers.written:
        zero["stage3_prefetch_bucket_size"] = buffers.prefetch_bucket_size
        zero["stage3_max_live_parameters"] = buffers.max_live_parameters
        zero["reduce_bucket_size"] = buffers.reduce_bucket_size
        zero["sub_group_size"] = buffers.sub_group_size
    if buffers.hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = buffers.hpz_partition_size
    if plan.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": plan.device == "cuda"}
    if plan.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": plan.device == "cuda"}
    config: dict = {
        "zero_optimization": zero,
        # The Trainer fills these from per_device_train_batch_size, gradient_accumulation_steps and max_grad_norm;
        # an explicit value that differs from them stops it. The plan's micro batch and accumulation: its record.
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto" if auto else plan.precision == "bf16"},
        "fp16": {"enabled": "auto" if auto else plan.precision == "fp16"},
        # bf16/fp16 runs still sum micro-batches and ranks in fp32 (DeepSpeed's default is the model's dtype).
        "data_types": {"grad_accum_dtype": "fp32"},
        # DeepSpeed 0.19.8 converts each gradient to this dtype before ZeRO-3's reduce-scatter (stage3.py
        # `__avg_scatter_grads`: `g.to(communication_data_type)`, then `reduce_scatter_coalesced`) and before
        # ZeRO-0/1/2's reductions (engine.py `allreduce_bucket`, stage_1_and_2.py); parameter gathers keep bf16.
        "communication_data_type": plan.grad_reduce_dtype,
    }
    if plan.sp > 1:
        # With an SP group DeepSpeed 0.19.8 reduces gradients in this key's dtype instead (engine.py:2182), fp32 when
        # absent: the plan's reduction dtype, so that --grad-reduce-dtype holds under SP too.
        config["seq_parallel_communication_data_type"] = plan.grad_reduce_dtype
    if plan.tp > 1:
        if model is None:
            raise ValueError("TP > 1 needs the model (--model) to write its tensor-parallel layer specs")
        config["tensor_parallel"] = {"autotp_size": plan.tp, "partition_config": partition_config(model.model_type)}
        if buffers.vocab_parallel_lm_head:
            # DeepSpeed swaps lm_head for its VocabParallelLinear (overriding the lm_head spec above, with a logged
            # warning) and installs its distributed loss as model.loss_function.
            config["tensor_parallel"]["vocab_parallel_lm_head"] = True
    if plan.ep > 1:
        if model is None or model.model_type not in EP_PRESETS:
            raise ValueError("EP > 1 needs a mixture-of-experts model with a DeepSpeed AutoEP preset (--model)")
        config["expert_parallel"] = {
            "enabled": True,
            "autoep_size": plan.ep,
            "preset_model": EP_PRESETS[model.model_type],
        }
    config[PLAN_KEY] = plan_record(plan, model_ref or (model.name if model is not None else None), model)
    config["steps_per_print"] = 1_000_000  # the Trainer logs; DeepSpeed's own step prints would only duplicate it
    config["wall_clock_breakdown"] = False
    return config
