"""Practice 3: ZeRO-3 with tensor (and expert) parallelism, through DeepSpeed and accelerate configs.

plan.ParallelPlan (the job and its rules) -> models (shapes, exact counts) -> tp_specs (what TP splits) ->
memory (per-rank estimate) -> deepspeed_config / accelerate_config (the files) -> lint (checks on any file);
batch (the global batch under TP) and launch_config (YAML + JSON consistency) serve the trainer and the demo;
launch_scripts (the sbatch script of a plan, Slurm + accelerate launch or torchrun) and launch_script_check.
"""
