"""RecipeTrainingArguments: `TrainingArguments` whose defaults are the seven practices, checked on creation.

(Longer than a few hundred lines because each of its fields carries its command-line help.) On creation,
`__post_init__` checks every field and derives the fields set after construction (`validate`, which changes nothing
outside the object), then applies the process-wide effects (`apply_process_effects`: environment variables, an
upstream patch), then runs the stock post-init (which creates the process group on a multi-process launch), then
sets the start-up timeout on the group (`apply_group_effects`), and seeds every process last.

Changed defaults (everything else is the stock default):
- `lr_scheduler_type="cosine_with_restarts"` with `lr_scheduler_kwargs={"num_cycles": 3}` and `warmup_steps=0.05`
  (5% of the optimizer steps; an integer >= 1 means steps) -- practice 6; `{"num_cycles": 1}` (one cosine, no
  restarts) where the arguments class is trl's (`SFTConfig`, `DPOConfig`, ...): those trainers fine-tune;
- `logging_nan_inf_filter=False`: a NaN loss shows in the logs instead of being averaged away -- practice 5;
- `log_level_replica="error"`: a transformers warning every rank meets is said once, by the main process (with
  `filter_stack_warnings`, the console rule of `monitoring.console` in a user's own script);
- `bf16=None`: bf16 where every visible GPU supports it, fp32 on CPU hosts; `bf16=False` chooses fp32
  (`hf_dist_recipes.environment.precision`);
- `activation_checkpointing=None`: what the launch config's recorded plan assumed (`config generate
  --activation-checkpointing`), else off (`hf_dist_recipes.parallel.plan_record`); a model that will not recompute
  under such a plan then stops RecipeTrainer with the fix, unless `allow_no_recompute=True`;
- `ddp_timeout=7200` s instead of 1800: under ZeRO-3 rank 0 alone reads the checkpoint in `from_pretrained` while
  the other ranks wait in collectives, and the first run of a node JIT-builds DeepSpeed's ops while its other ranks
  wait; 30 minutes is too short for a 1.3 TB checkpoint on network storage (about 45 minutes at 500 MB/s). It is the
  start-up timeout: once the first optimizer step finished, `step_timeout` takes over (below). Every process group
  has it once the arguments exist, whoever created the group (`comm.process_setup`: transformers gives a use_cpu
  group none, torch's 30 minutes; a script's own TrainingArguments give theirs);
- `ddp_backend`: NCCL on a CUDA host, Gloo only without CUDA (an explicit "gloo" on a CUDA host is an error) --
  practice 2; `use_cpu=True` on hosts without CUDA, where the stock default miscounts the world size.

New fields, all at the end so positional use of TrainingArguments keeps working:
- `logging_dir` (default `$TENSORBOARD_LOGGING_DIR`, else `<output_dir>/tensorboard`): parent of the per-rank
  TensorBoard runs `rank<N>`;
- `per_rank_tensorboard` (default True) -- practice 7;
- `min_lr_ratio` (default 0.0): floor of the cosine cycles as a fraction of the peak learning rate;
- `save_shard_size` (default "5GB"): largest weight file of `save_model` under DeepSpeed, which bounds the memory
  of the writing rank (one shard plus one decoder layer);
- `hf_weights_in_checkpoints` (default False): under DeepSpeed a `checkpoint-N` holds what resume needs (the
  engine's files, written by every rank at once, the config, the trainer state); True also writes the
  `from_pretrained` weights into each (shared by all ranks, as `save_model`);
- `loss_chunk_tokens` (default None: what the launch config's plan recorded, `config generate --loss-chunk-tokens`,
  else the stock loss; 0: the stock loss): while training, the causal-LM loss is computed this many tokens at a time,
  so the full tokens x vocabulary fp32 logits never exist (`hf_dist_recipes.parallel.chunked_loss`; the estimate
  counts one chunk's logits, `planning.memory.chunked_logits_bytes`); evaluation and prediction keep the stock loss
  and its logits;
- `tiled_mlp_shards` (default None: what the launch config's plan recorded, else off; 0 or 1: off): every gated MLP
  computes that many slices of its tokens at a time, each recomputed in the backward pass (`parallel.tiled_mlp`);
- `sp_eval_max_length` (default None): under Ulysses SP, the longest eval sequence in tokens; evaluation runs each
  sequence whole on every rank (accelerate's `sp_disable_in_eval`), and a longer batch stops it with the fix
  (`hf_dist_recipes.parallel.sequence_parallel`);
- `memory_mapped_resume` (default True): under DeepSpeed, a resume reads the engine's checkpoint files memory-mapped
  and copies the optimizer states out one tensor at a time, so that the host memory of a resume stays at the
  steady state instead of adding up to one optimizer file per process (`hf_dist_recipes.checkpoint.resume_loading`);
- `max_unpartitioned_model_size` (default "2GB"): under ZeRO-3, a model larger than this whose parameters were not
  partitioned while it was built (built before the arguments, or by calling its class) stops RecipeTrainer with the
  fix (`hf_dist_recipes.parallel.construction`); None turns the check off;
- seeds: `seed_check` (default "error"; "warn", "off"): what a cross-rank disagreement on seeds, data order, built
  weights or, every `rank_check_steps` (default 100; 0 off) optimizer steps, on the step, learning rate and (inside
  a TP group) loss, batch and dropout stream does; `per_rank_dropout` (default False): distinct dropout streams per
  data-parallel replica (`reproducibility.rank_agreement`). The arguments also seed every process when created
  (`seed_everything(seed, deterministic=full_determinism)`), so a model built after them is the same on every run;
- schedule: `restart_warmup_steps` (default 0: hard restarts): optimizer steps over which each restart climbs
  linearly from the floor back to the peak (`schedules.warmup_cosine`). `min_lr_ratio`, `restart_warmup_steps`
  may also come in `lr_scheduler_kwargs` (what a plain `TrainingArguments` can carry): they move into the
  fields, `lr_scheduler_kwargs` keeps `num_cycles` only, and one value given both ways differently is an error;
- gradient health: `nonfinite_policy` (default "skip"; "halt", "off"): what a non-finite loss or gradient on any
  rank does; `max_consecutive_skips` (default 3): more skips in a row halt; `spike_window` (default 50 steps) and
  `spike_threshold` (default 6.0, robust z-score): loss and grad-norm spike events
  (`hf_dist_recipes.stability.gradient_health`);
- straggler detection: `straggler_check_steps` (default 50; 0 off): optimizer steps between checks where the
  ranks compare their busy time per step; `straggler_threshold` (default 0.2): fraction above the median rank's
  that counts as slow; `straggler_windows` (default 2): checks in a row before a rank is flagged, with its host, as
  a warning and a `straggler_event` in the logs (`hf_dist_recipes.monitoring.stragglers`);
- hangs: `peer_timeout` (default 120 s; 0 off): a rank whose heartbeat stops for this long (killed, host down) ends
  every other rank, naming it, its host and its last step (`comm.watchdog`); `step_timeout` (default 600 s,
  torch's NCCL default; 0 keeps `ddp_timeout`): the collective timeout once the first optimizer step finished, which
  bounds a rank that is alive but stuck. On creation, where the backend is NCCL, the NCCL defaults of
  `hf_dist_recipes.comm.nccl_defaults` (async error handling, flight recorder dumped into
  `<output_dir>/flight_recorder`; any other backend gets the recorder's buffer size only) are set where the user
  has not set them, before the process group exists. Where CUDA is used, `PYTORCH_CUDA_ALLOC_CONF=
  expandable_segments:True` is set the same way, before CUDA initialises, unless the allocator was configured
  (`environment.alloc_defaults`). This process's record (`comm.process_setup.current()`, `trainer.runtime.process`;
  not the arguments': they are the process's facts) keeps every variable set (`env_applied`, of which
  `nccl_env_applied`), each of them and the collective timeout with when it was applied (`settings`: before the
  process group existed, after it, or too late), and the seeding (`seed_report`). A group that existed before the
  arguments (a script's own TrainingArguments made it, and RecipeTrainer upgraded them) read none of these
  variables: one warning names them with the fix; on NCCL it is an error unless `allow_late_process_setup=True`;
- `expert_bias_balancing` (default True): a model whose MoE routers choose experts with DeepSeek-V3's correction
  bias (`e_score_correction_bias`) gets `ExpertBiasBalancer()` (`hf_dist_recipes.moe.expert_balance`), which moves
  that bias towards even expert load after every optimizer step (one you registered, with your gamma, takes its
  place). False leaves the bias frozen, as transformers does, and warns once: the memory estimate assumes even
  routing, and an EP rank above the mean load needs more. Models without such routers: no effect;
- `auto_resume` (default off; `HF_DIST_RECIPES_AUTO_RESUME=1`, which the generated launch scripts export, turns it
  on): `train()` without `resume_from_checkpoint` resumes from the newest complete checkpoint in `output_dir`, or
  starts fresh, and says which (`hf_dist_recipes.checkpoint.auto_resume`; complete: `checkpoint.manifest`);
- `preemption_signals` (default SIGTERM,SIGUSR2; "none" off): on one of them reaching any rank, every rank saves
  the same step's checkpoint and exits with code 75 (`hf_dist_recipes.checkpoint.preemption`);
- `allow_gloo_on_cuda`, `allow_unclipped_gradients`, `allow_cpu_with_gpus`, `allow_no_recompute`,
  `allow_late_process_setup` (default False): explicit opt-outs. `allow_cpu_with_gpus` is for a machine with NVIDIA
  GPUs that torch cannot use (CPU-only wheel, old driver, every GPU hidden), which otherwise stops with the reason
  and the fix instead of training on the CPU (`hf_dist_recipes.environment.cuda_host`).

On creation the arguments also point `TORCH_EXTENSIONS_DIR`, when it is unset, at a node-local folder, so that
DeepSpeed's JIT-built ops are built once per node rather than by every node into one shared home folder
(`hf_dist_recipes.environment.extensions`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.trainer_utils import SchedulerType

from hf_dist_recipes import argument_classes
from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes._compat import transformers as compat_transformers
from hf_dist_recipes.checkpoint.auto_resume import resolve_auto_resume
from hf_dist_recipes.checkpoint.preemption import DEFAULT_PREEMPTION_SIGNALS, PREEMPTED_EXIT_CODE, parse_signals
from hf_dist_recipes.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from hf_dist_recipes.comm import backend, process_setup
from hf_dist_recipes.comm.nccl_defaults import apply_flight_recorder_env_defaults, apply_nccl_env_defaults
from hf_dist_recipes.comm.restarts import fresh_rendezvous_after_restart
from hf_dist_recipes.comm.watchdog import validate_hang_settings
from hf_dist_recipes.core.jsonfile import read_deepspeed_argument
from hf_dist_recipes.core.sizes import parse_size
from hf_dist_recipes.core.user_values import positive_int
from hf_dist_recipes.environment import cuda_host, extensions, precision
from hf_dist_recipes.environment.alloc_defaults import apply_alloc_conf_default, apply_offload_defaults
from hf_dist_recipes.environment.precision import resolve_bf16
from hf_dist_recipes.monitoring.console import quiet_the_stack
from hf_dist_recipes.monitoring.stragglers import (
    DEFAULT_STRAGGLER_CHECK_STEPS,
    DEFAULT_STRAGGLER_THRESHOLD,
    DEFAULT_STRAGGLER_WINDOWS,
    validate_straggler_settings,
)
from hf_dist_recipes.parallel.batch import fix_tp_batch_size, validate_micro_batch
from hf_dist_recipes.parallel.checkpoint_bytes import DEFAULT_DDP_TIMEOUT
from hf_dist_recipes.parallel.chunked_loss import validate_loss_chunk_tokens
from hf_dist_recipes.parallel.plan_record import recorded_plan
from hf_dist_recipes.reproducibility.rank_agreement import SeedCheck, validate_policy, validate_rank_check_steps
from hf_dist_recipes.reproducibility.seeding import seed_everything, validate_seed
from hf_dist_recipes.schedules.scheduler_kwargs import (
    RECIPE_SCHEDULER,
    default_num_cycles,
    schedule_kwargs_into_fields,
)
from hf_dist_recipes.schedules.warmup_cosine import (
    validate_learning_rate,
    validate_min_lr_ratio,
    validate_warmup_steps,
)
from hf_dist_recipes.stability.gradients import validate_max_grad_norm
from hf_dist_recipes.stability.nonfinite import (
    NonFinitePolicy,
    validate_max_consecutive_skips,
    validate_nonfinite_policy,
)
from hf_dist_recipes.stability.spikes import validate_spike_settings

logger = logging.getLogger(__name__)


def _option(default, help: str, **metadata):
    """A field the user sets: its default and its command-line help (`metadata`: more of HfArgumentParser's
    keywords)."""
    return field(default=default, metadata={"help": help, **metadata})


def _derived(default, help: str):
    """A field set on creation from the others, never given (see `RecipeTrainingArguments.validate`)."""
    kind = {"default_factory": default} if callable(default) else {"default": default}
    return field(init=False, repr=False, compare=False, metadata={"help": help}, **kind)


@dataclass
class RecipeTrainingArguments(TrainingArguments):
    lr_scheduler_type: SchedulerType | str = _option(
        RECIPE_SCHEDULER.value,
        "Learning-rate schedule; the recipe default is linear warm-up + cosine with hard restarts.",
    )
    warmup_steps: float = _option(
        0.05, "Linear warm-up: optimizer steps if >= 1, else a ratio of all steps (default 0.05)."
    )
    logging_nan_inf_filter: bool = _option(
        False, "Hide NaN/Inf losses in the logs. Off in the recipe: a NaN must be seen."
    )
    bf16: bool | None = _option(
        None,
        "bf16 mixed precision. Default: on when every visible GPU supports bf16 (compute "
        "capability >= 8.0), off on CPU hosts. False trains in fp32.",
        nargs="?",
        const=True,
    )
    activation_checkpointing: bool | None = _option(
        None,
        "Recompute activations in the backward pass. Default: what the launch config's plan "
        "assumed (config generate --activation-checkpointing), else off.",
        nargs="?",
        const=True,
    )
    log_level_replica: str = _option(
        "error",
        "transformers' log level on every rank but the main one (default error: a warning every rank meets alike is "
        "said once, by rank 0; the stock default is warning).",
        choices=["detail", "debug", "info", "warning", "error", "critical", "passive"],
    )
    ddp_timeout: int = _option(
        DEFAULT_DDP_TIMEOUT,
        "Seconds a collective may wait during start-up (default 7200: rank 0 reads a large "
        "checkpoint alone under ZeRO-3 while the others wait); step_timeout applies once steps "
        "run.",
    )
    logging_dir: str | None = _option(
        None,
        "TensorBoard root; each rank writes <logging_dir>/rank<N>. Default $TENSORBOARD_LOGGING_DIR (the stock "
        "TensorBoardCallback's), else <output_dir>/tensorboard.",
    )
    per_rank_tensorboard: bool = _option(True, "Write TensorBoard logs from every rank, not only rank 0.")
    min_lr_ratio: float = _option(0.0, "Floor of each cosine cycle, as a fraction of the peak learning rate.")
    save_shard_size: str = _option(
        DEFAULT_MAX_SHARD_SIZE,
        "Largest safetensors file save_model writes under DeepSpeed (5GB = 5e9 bytes, 5GiB = 5 x 2^30, "
        "500MB, or a byte count). The "
        "writing rank holds at most one shard plus one decoder layer (default 5GB).",
    )
    hf_weights_in_checkpoints: bool = _option(
        False,
        "Under DeepSpeed, also write a from_pretrained copy of the weights into every checkpoint-N "
        "(resume needs only the engine's files, which every rank writes; save_model and checkpoint export "
        "write the HF checkpoint). Default False.",
    )
    loss_chunk_tokens: int | None = _option(
        None,
        "Compute the training loss this many tokens at a time (LM head + fp32 cross-entropy per chunk, "
        "recomputed in the backward pass), so the tokens x vocabulary logits never exist whole. Default: what "
        "the launch config's plan recorded (config generate --loss-chunk-tokens), else off; 0: off (the stock "
        "loss). Evaluation and prediction keep the stock loss.",
    )
    tiled_mlp_shards: int | None = _option(
        None,
        "Compute each gated MLP (gate/up/down projections) this many slices of the tokens at a time, recomputing "
        "each slice in the backward pass (ALST's TiledMLP): only one slice's intermediate activations exist. "
        "DeepSpeed or one process only. Default: what the launch config's plan recorded (config generate "
        "--tiled-mlp-shards), else off; 0 or 1: off.",
    )
    sp_eval_max_length: int | None = _option(
        None,
        "Under Ulysses sequence parallelism (sp_size > 1) evaluation runs unsharded, as accelerate's "
        "sp_disable_in_eval has it: every rank runs each eval sequence whole, with all of its memory. An eval batch "
        "longer than this many tokens stops evaluation, naming the fix, before it runs out of memory. Default "
        "None: no limit (said once, at the first evaluation under SP).",
    )
    memory_mapped_resume: bool = _option(
        True,
        "Under DeepSpeed, read the checkpoint files of a resume with torch.load(mmap=True) and copy the "
        "optimizer states out one tensor at a time: a resume needs the steady-state host memory, not that plus "
        "up to one optimizer file per process. False: DeepSpeed's plain torch.load (a file system where mmap is "
        "slow or unsupported). Default True.",
    )
    auto_resume: bool = _option(
        False,
        "train() without resume_from_checkpoint (None or False) resumes from the newest complete "
        "checkpoint in output_dir (one whose manifest and files agree; each newer incomplete one is named), or "
        "starts fresh when there is none, and says which; resume_from_checkpoint=True takes the newest complete "
        "one too, and a path always wins. Default False, as the stock Trainer; HF_DIST_RECIPES_AUTO_RESUME=1 in "
        "the environment turns it on (the generated Slurm and torchrun scripts export it).",
    )
    preemption_signals: str = _option(
        DEFAULT_PREEMPTION_SIGNALS,
        "signals (comma-separated) on which every rank agrees, at the next step end, to save a checkpoint "
        f"and exit with code {PREEMPTED_EXIT_CODE}, so that a job requeued or restarted with auto_resume loses no "
        "step: a scheduler's SIGTERM (torchrun forwards it to every rank), SIGUSR2 sent to the ranks. Costs one "
        "all-reduce of two integers per step. 'none' keeps the stock behaviour (the process dies). Not SIGUSR1, "
        "which writes a rank's state for `hf-dist-recipes logs hang`.",
    )
    max_unpartitioned_model_size: str | None = _option(
        "2GB",
        "Under ZeRO-3, stop when a model larger than this was built without being partitioned "
        "(every rank holds a full copy), e.g. 2GB (2e9 bytes) or 2GiB (2 x 2^30). None: no check.",
    )
    # seeds
    # Literal: HfArgumentParser renders a closed set as argparse choices (tests/unit/test_argument_cli.py).
    seed_check: SeedCheck = _option(
        "error",
        "Ranks that disagree on seeds, data order, built weights or (every rank_check_steps) the "
        "step, learning rate, TP-group loss: 'error' stops the job, 'warn' logs, 'off' skips.",
    )
    rank_check_steps: int = _option(100, "Optimizer steps between cross-rank agreement checks (0: only at start).")
    per_rank_dropout: bool = _option(
        False,
        "Distinct dropout streams per data-parallel replica (TP ranks always share one); "
        "weights and data order stay identical.",
    )
    # schedule
    restart_warmup_steps: int = _option(
        0,
        "Optimizer steps of linear re-warm-up from the floor to the peak at each restart of "
        "cosine_with_restarts (default 0: hard restarts, straight back to the peak).",
    )
    # gradient health
    nonfinite_policy: NonFinitePolicy = _option(
        "skip",
        "A non-finite loss or gradient on any rank: 'skip' the optimizer step on every rank "
        "(counted, logged), 'halt' (save the last good state, stop non-zero with a report), "
        "'off' (no checks).",
    )
    max_consecutive_skips: int = _option(
        3, "Under nonfinite_policy='skip', more skips in a row than this halt the job."
    )
    spike_window: int = _option(50, "Steps of loss and grad norm a spike is measured against (robust z-score).")
    spike_threshold: float = _option(6.0, "Robust z-score (median/MAD) above the window that makes a spike event.")
    # straggler detection
    straggler_check_steps: int = _option(
        DEFAULT_STRAGGLER_CHECK_STEPS,
        "Optimizer steps between cross-rank straggler checks (the same step on every rank; 0: off).",
    )
    straggler_threshold: float = _option(
        DEFAULT_STRAGGLER_THRESHOLD,
        "A rank whose busy time per step exceeds the median rank's by more than this fraction "
        "(0.2: 20 percent) is slow in that window.",
    )
    straggler_windows: int = _option(
        DEFAULT_STRAGGLER_WINDOWS, "Checks in a row a rank must be slow in before it is flagged as a straggler."
    )
    # hangs
    peer_timeout: float = _option(
        120.0,
        "Seconds without a heartbeat from a peer rank (killed, host down) before every other rank "
        "ends, naming it and its last step (default 120; 0: off).",
    )
    step_timeout: float = _option(
        600.0,
        "Collective timeout in seconds once the first optimizer step finished; bounds a rank "
        "that is alive but stuck (default 600, torch's NCCL default; 0: keep ddp_timeout).",
    )
    # mixture of experts
    expert_bias_balancing: bool = _option(
        True,
        "For MoE routers that choose experts with DeepSeek-V3's correction bias "
        "(e_score_correction_bias): move each expert's bias towards even load after every optimizer step "
        "(ExpertBiasBalancer, gamma 0.001). False keeps the bias frozen and warns: EP ranks above the mean "
        "load then need more memory than the estimate, which assumes even routing. Other models: no effect.",
    )
    filter_stack_warnings: bool = _option(
        True,
        "Hide the warnings the stack repeats on every rank (torch's FutureWarning for each collective DeepSpeed "
        "calls, every step; DeepSpeed's 'Setting accelerator to CPU' on a CPU run); False shows them.",
    )
    allow_gloo_on_cuda: bool = _option(False, "Accept Gloo on a host with CUDA GPUs (normally an error).")
    allow_unclipped_gradients: bool = _option(
        False, "Accept max_grad_norm=0 (no gradient clipping; normally an error)."
    )
    allow_cpu_with_gpus: bool = _option(
        False,
        "Train on the CPU although the machine has NVIDIA GPUs that torch cannot use (normally "
        "an error naming the reason: CPU-only torch, old driver, CUDA_VISIBLE_DEVICES hiding "
        "them).",
    )
    allow_no_recompute: bool = _option(
        False,
        "Train without recomputation although the launch config's plan assumed activation checkpointing "
        "(normally an error naming the fix: its memory estimate does not hold without it).",
    )
    allow_late_process_setup: bool = _option(
        False,
        "Accept an NCCL process group created before these arguments (by a script's own "
        "TrainingArguments), which never read the recipe's NCCL error handling and flight recorder settings "
        "(normally an error naming them; a warning on Gloo). Arguments without this field: "
        "HF_DIST_RECIPES_ALLOW_LATE_PROCESS_SETUP=1.",
    )
    # Set on creation, never given: init=False keeps them out of the constructor, HfArgumentParser and to_dict()
    # (training_args.json); compare=False keeps equality about what the user chose.
    save_shard_bytes: int = _derived(0, "save_shard_size in bytes")
    max_unpartitioned_model_bytes: int | None = _derived(None, "max_unpartitioned_model_size in bytes; None: no check")
    launch_plan: dict = _derived(dict, "the plan recorded in the DeepSpeed config (`parallel.plan_record`); {} if none")
    autotp_size: int = _derived(1, "DeepSpeed AutoTP degree of the DeepSpeed config the arguments read (1: no TP)")
    tp_batch_note: str | None = _derived(None, "what the DeepSpeed batch fix under AutoTP changed, in words")
    activation_checkpointing_from_plan: bool = _derived(
        False, "activation_checkpointing was chosen by the launch plan (RecipeTrainer may turn it off), not the user"
    )

    def __post_init__(self):
        """Check every field and derive the fields above (`validate`: nothing outside this object changes), then
        apply the process-wide effects (`apply_process_effects`: environment variables, the upstream patch), then
        the stock post-init, which creates the process group, then what needs the group (`apply_group_effects`: the
        start-up timeout); seed every process last."""
        if self.filter_stack_warnings:  # first: validating reads the DeepSpeed config through DeepSpeed
            quiet_the_stack(cpu_run=cuda_host.cpu_request(self.use_cpu) or not backend.cuda_device_count())
        self.validate()
        # Before anything of ours: a group that exists now was made by someone else's arguments (the plain route).
        group_existed = process_setup.group_exists()
        apply_process_effects(self, group_existed=group_existed)
        # After the allocator default (apply_process_effects): reading the GPUs' capability initialises CUDA.
        gpus = 0 if self.use_cpu else backend.cuda_device_count()
        self.bf16 = resolve_bf16(
            self.bf16, fp16=self.fp16, cuda_devices=gpus, bf16_supported=bool(gpus) and precision.cuda_bf16_supported()
        )
        super().__post_init__()
        apply_group_effects(self, group_existed=group_existed)
        schedule_kwargs_into_fields(self)  # after super(): it parses a JSON string
        if self.lr_scheduler_type == RECIPE_SCHEDULER and not self.lr_scheduler_kwargs:
            self.lr_scheduler_kwargs = {"num_cycles": default_num_cycles(type(self))}
        if self.logging_dir is None:  # transformers 5 reads TensorBoard's folder from the environment alone
            tensorboard_dir = os.environ.get("TENSORBOARD_LOGGING_DIR")
            self.logging_dir = (
                os.path.expanduser(tensorboard_dir) if tensorboard_dir else os.path.join(self.output_dir, "tensorboard")
            )
        # Last, so nothing above draws from the seeded state: a model built after the arguments (the order of the
        # HF examples, without set_seed) gets the same weights on every run.
        process_setup.record(seed_report=seed_everything(self.seed, deterministic=self.full_determinism))

    def validate(self) -> None:
        """The recipe's checks of every field it adds or changes (ValueError naming the fix), and the fields derived
        from them. Reads the host (GPUs, the launcher's DeepSpeed config) but changes nothing outside this object."""
        validate_seed(self.seed)
        # The same rules as the demo's flags (one source: the concept's module), named as the arguments spell them.
        validate_micro_batch(self.per_device_train_batch_size, "per_device_train_batch_size")
        validate_learning_rate(self.learning_rate)
        if self.max_steps > 0 and self.warmup_steps >= 1:  # steps; a ratio (< 1) fits any length of run
            validate_warmup_steps(int(self.warmup_steps), self.max_steps, ("warmup_steps", "max_steps"))
        validate_policy(self.seed_check)
        validate_rank_check_steps(self.rank_check_steps)
        validate_nonfinite_policy(self.nonfinite_policy)
        validate_max_consecutive_skips(self.max_consecutive_skips)
        validate_spike_settings(self.spike_window, self.spike_threshold)
        validate_straggler_settings(self.straggler_check_steps, self.straggler_threshold, self.straggler_windows)
        validate_hang_settings(self.peer_timeout, self.step_timeout)
        self.max_grad_norm = validate_max_grad_norm(self.max_grad_norm, allow_unclipped=self.allow_unclipped_gradients)
        validate_min_lr_ratio(self.min_lr_ratio)
        self.save_shard_bytes = parse_size(self.save_shard_size, "save_shard_size")
        self.auto_resume = resolve_auto_resume(self.auto_resume)  # or the launch script's environment
        parse_signals(self.preemption_signals)  # an unknown or reserved name stops here, naming the fix
        if str(self.max_unpartitioned_model_size).lower() in ("none", "off"):  # None, or "none" from a command line
            self.max_unpartitioned_model_size = None
        self.max_unpartitioned_model_bytes = (
            None
            if self.max_unpartitioned_model_size is None
            else parse_size(self.max_unpartitioned_model_size, "max_unpartitioned_model_size")
        )
        # An explicit CPU request (use_cpu=True, a launch config's use_cpu: true) trains on the CPU even where GPUs
        # are visible, so the backend and precision below are chosen for the CPU (Gloo, fp32).
        cpu_asked = cuda_host.cpu_request(self.use_cpu)
        gpus = 0 if cpu_asked else backend.cuda_device_count()
        if not gpus:
            # Without this, a GPU node whose torch cannot reach its GPUs would train on the CPU (use_cpu below).
            cuda_host.check_torch_sees_gpus(
                cuda_devices=gpus, allow_cpu_with_gpus=self.allow_cpu_with_gpus, cpu_requested_by=cpu_asked
            )
        # A process no launcher started (`python train.py` on one GPU) has no process group to create: NCCL there
        # makes the stock post-init ask a group nobody made for its world size. Left unset, as the stock default.
        launched = "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.ddp_backend is not None or (gpus and launched):
            # Without CUDA and without a request, the launcher's Gloo default is right and left alone.
            self.ddp_backend = backend.resolve_backend(
                self.ddp_backend, allow_gloo_on_cuda=self.allow_gloo_on_cuda, cuda_devices=gpus
            )
        if not gpus and not self.use_cpu:
            # Without use_cpu a CPU-only torchrun run counts world_size 1 and fills DeepSpeed's batch wrongly.
            self.use_cpu = True
        self.tp_batch_note = self._fix_deepspeed_batch()
        if self.loss_chunk_tokens is None:  # the plan's memory estimate counted one chunk's logits, not all of them
            self.loss_chunk_tokens = self.launch_plan.get("loss_chunk_tokens")
        if self.loss_chunk_tokens != 0:
            validate_loss_chunk_tokens(self.loss_chunk_tokens, off="0 or None for the stock loss")
        if self.tiled_mlp_shards is None:  # the plan's memory estimate counted one slice's MLP activations
            self.tiled_mlp_shards = self.launch_plan.get("tiled_mlp_shards")
        if self.tiled_mlp_shards is not None:
            note = "0 or 1: off"
            positive_int(self.tiled_mlp_shards, "tiled_mlp_shards", 4, minimum=0, unit="slices", note=note)
        if self.sp_eval_max_length is not None:
            note = "or None for no limit"
            positive_int(self.sp_eval_max_length, "sp_eval_max_length", 32768, unit="tokens", note=note)
        # Whether the plan chose it: RecipeTrainer may turn such a value off under allow_no_recompute, never the user's.
        self.activation_checkpointing_from_plan = False
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = bool(self.launch_plan.get("activation_checkpointing"))
            self.activation_checkpointing_from_plan = self.activation_checkpointing
            if self.activation_checkpointing:
                logger.info("activation_checkpointing on: the launch config's plan assumed it")

    def _raise_startup_timeout(self, need: int | None) -> None:
        """The recorded plan's start-up timeout (`config generate`: rank 0 reading the weights,
        `parallel.checkpoint_bytes.startup_timeout_s`): a `ddp_timeout` left at the recipe default is raised to it
        (before the process group exists, which takes it); one the script chose is kept, with a warning."""
        if not isinstance(need, int) or need <= self.ddp_timeout:
            return
        if self.ddp_timeout == DEFAULT_DDP_TIMEOUT:
            logger.info(
                f"ddp_timeout {self.ddp_timeout} -> {need} s: the launch plan's start-up needs it (config generate)"
            )
            self.ddp_timeout = need
        else:
            logger.warning(
                f"ddp_timeout {self.ddp_timeout} s is less than the {need} s the launch plan's start-up needs (rank 0 "
                "reading the weights while the others wait): a slow load ends as a collective timeout; raise it"
            )

    def _fix_deepspeed_batch(self) -> str | None:
        """Trap 1: under DeepSpeed AutoTP, make the global batch micro x accumulation x data-parallel size.

        A TP config that `accelerate launch` handed over is also adopted as `self.deepspeed`: transformers 5.24
        reads the TP degree (`Trainer.get_tp_size`, used for the global batch and the loss scale) only from a
        config given to the arguments. Left on the launcher route, the Trainer counts TP 1: measured on 4 CPU
        ranks with TP 2, a global batch of 16 instead of 8.
        """
        from_launcher = self.deepspeed is None
        if from_launcher:
            raw = compat_accelerate.launcher_deepspeed_config()
        elif isinstance(self.deepspeed, dict):
            raw = self.deepspeed
        else:
            raw = read_deepspeed_argument(self.deepspeed)  # a file, a JSON or base64 string, as the stock reads it
        self.launch_plan = recorded_plan(raw)
        self._raise_startup_timeout(self.launch_plan.get("startup_timeout_s"))
        if raw is None:
            return None
        fix = fix_tp_batch_size(  # reads the config through DeepSpeedView once, its TP degree included
            raw,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            micro_batch=self.per_device_train_batch_size,
            grad_accum=self.gradient_accumulation_steps,
        )
        self.autotp_size = fix.tp
        if fix.change is not None:
            logger.info(fix.change)
        if fix.change is not None or (from_launcher and self.autotp_size > 1):
            self.deepspeed = fix.config
        return fix.change

    @classmethod
    def from_training_arguments(
        cls, args: TrainingArguments, base: type[TrainingArguments] | None = None
    ) -> RecipeTrainingArguments:
        """Upgrade a user's arguments: a `TrainingArguments` subclass `C` (`Seq2SeqTrainingArguments`, trl's
        `SFTConfig`, the user's own) becomes a `Recipe<C>`, an instance of both `C` and this class, and keeps every
        field and method of `C`; a plain `TrainingArguments` becomes this class. Every field the user changed from
        its default is kept; fields left at their default take the recipe default (`hf_dist_recipes.
        argument_classes`). `base`: the arguments class the Trainer needs, used when `args` is not one."""
        if base is None and cls is not RecipeTrainingArguments:  # a subclass of ours: upgrade into it
            base = cls
        return argument_classes.upgrade(args, base, RecipeTrainingArguments)


def recipe_arguments(base: type[TrainingArguments]) -> type[RecipeTrainingArguments]:
    """The recipe's arguments class for the arguments class `base` (`recipe_arguments(SFTConfig)` is
    `RecipeSFTConfig`: an `SFTConfig` and a `RecipeTrainingArguments`; `TrainingArguments` gives
    `RecipeTrainingArguments`). Build the arguments with it to keep a stock default the recipe would replace:
    every value given to it is kept as given, where an upgraded `SFTConfig` cannot tell a value left at its default
    from the same value given (`argument_classes.upgrade`)."""
    return argument_classes.recipe_arguments_class(base, RecipeTrainingArguments)


def apply_process_effects(args: RecipeTrainingArguments, *, group_existed: bool | None = None) -> None:
    """What creating the arguments changes for the whole process, after `args.validate()`; run once by
    `__post_init__` before the stock post-init (seeding, last, is the post-init's own). Starts this process's record
    (`comm.process_setup.current()`) with the environment variables it set, each with when (`group_existed`: the
    process group existed before the arguments; None: look now).

    - `TORCH_EXTENSIONS_DIR` (when unset) at a node-local folder: before DeepSpeed builds or loads any op (on GPU
      hosts the stock post-init already starts DeepSpeed's comm: accelerate 1.16 PartialState ->
      `deepspeed.init_distributed`; the engine builds cpu_adam & co. later);
    - the NCCL defaults (`comm.nccl_defaults`) where the backend is NCCL: before the stock post-init, where
      accelerate's PartialState creates the group on GPU hosts (torch reads them once, when ProcessGroupNCCL is built);
      on any other backend the flight recorder's buffer size alone;
    - `PYTORCH_CUDA_ALLOC_CONF` (`environment.alloc_defaults`) where CUDA is used: before CUDA initialises (the bf16
      resolution after this reads the GPUs' capability); the estimate's fragmentation allowance assumes expandable
      segments;
    - under DeepSpeed AutoTP, the upstream patch that lets `from_pretrained` convert weights
      (`_compat.transformers.allow_weight_conversions_under_training_autotp`): it comes after the arguments in every HF
      example;
    - after a launcher's restart (`--max_restarts`), this attempt's own rendezvous (`comm.restarts`)."""
    extensions.use_node_local_extensions_dir()
    nccl = (
        apply_nccl_env_defaults(args.output_dir or "trainer_output") if args.ddp_backend == backend.GPU_BACKEND else {}
    )
    gpus = 0 if args.use_cpu else backend.cuda_device_count()
    # Any other backend (Gloo) keeps the flight recorder on too: every rank dumps it when a job hangs.
    recorder = apply_flight_recorder_env_defaults() if args.ddp_backend != backend.GPU_BACKEND else {}
    applied = {**nccl, **recorder, **(apply_alloc_conf_default() if gpus else {})}
    if gpus and args.launch_plan:  # a generated plan's offload (a hand-written JSON: the launch script's exports)
        plan = args.launch_plan
        applied |= apply_offload_defaults(optimizer=plan.get("offload_optimizer"), params=plan.get("offload_params"))
    if group_existed is None:
        group_existed = process_setup.group_exists()
    if not group_existed:
        fresh_rendezvous_after_restart()  # a restarted rank meets its peers in a store of its own attempt
    settings = tuple(process_setup.environment_settings(applied, group_existed=group_existed))
    process_setup.record(fresh=True, nccl_env_applied=nccl, env_applied=applied, settings=settings)
    if args.autotp_size > 1:
        compat_transformers.allow_weight_conversions_under_training_autotp()


def apply_group_effects(args: RecipeTrainingArguments, *, group_existed: bool) -> None:
    """After the stock post-init, which creates the process group on a multi-process launch: every group's collective
    timeout becomes `ddp_timeout` (`comm.process_setup.apply_startup_timeout`), recorded in the process's record,
    before the script loads its model. Then what could not take effect because the group existed before the
    arguments (`group_existed`: a script's own TrainingArguments made it) is named in one warning with the fix, an
    error on NCCL unless `allow_late_process_setup` (`comm.process_setup.check_late_setup`)."""
    timeout = process_setup.apply_startup_timeout(args.ddp_timeout, group_existed=group_existed)
    if timeout is not None:
        process_setup.record(settings=(*process_setup.current().settings, timeout))
    base = getattr(type(args), "_recipe_base", None)  # set on a Recipe<C> (argument_classes)
    arguments = (
        "RecipeTrainingArguments(...)"
        if base is None
        else f"recipe_arguments_class({base.__name__}, RecipeTrainingArguments)(...) (hf_dist_recipes."
        f"argument_classes: a {base.__name__} with the recipe)"
    )
    process_setup.check_late_setup(
        list(process_setup.current().settings),
        group_existed=group_existed,
        arguments=arguments,
        backend=process_setup.group_backend(),
        allow=args.allow_late_process_setup,
    )
