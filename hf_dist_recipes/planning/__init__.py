"""Practice 3 before the job: plan, estimate, generate and check the launch files (`config generate / estimate /
validate / suggest`, `preflight`'s plan check, the demo's launch). No training rank imports this folder.

The plan and its memory estimate: plan.ParallelPlan (the job and its rules) -> models (shapes, exact counts) ->
tp_specs (what TP splits) -> elements, zero_buffers -> memory (per-rank estimate). On them: comm (traffic, step
time) -> suggest, fit (a plan against the GPU memory) -> deepspeed_config / accelerate_config / generate / shipped
(the files) -> lint + initialize_rules (checks on any file); launch_config (a user's YAML + JSON read once) and
launch_plan; launch_scripts (the sbatch script of a plan, Slurm + accelerate launch or torchrun) and
launch_script_check.
"""
