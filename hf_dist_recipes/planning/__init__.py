"""Practice 3 before the job: plan, estimate, generate and check the launch files (`config generate / estimate /
validate / suggest`, `preflight`'s plan check, the demo's launch). No training rank imports this folder.

The plan and its memory estimate: plan.ParallelPlan (the job and its rules) -> models (shapes, exact counts) ->
tp_specs (what TP splits) -> elements, zero_buffers -> memory (per-rank estimate). On them: comm (traffic, step
time) -> suggest, fit (a plan against the GPU memory) -> deepspeed_config / accelerate_config / generate / shipped
(the files) -> lint + initialize_rules (checks on any file); launch_config (a user's YAML + JSON read once) and
launch_plan; launch_scripts (the sbatch script of a plan, Slurm + accelerate launch or torchrun) and
launch_script_check.
"""

from hf_dist_recipes.core.public_names import lazy_names

# The names a notebook or a script uses; everything else in the package's modules is internal (core.public_names).
_PUBLIC = {
    "ParallelPlan": "hf_dist_recipes.planning.plan",
    "introspect": "hf_dist_recipes.planning.models",
    "estimate": "hf_dist_recipes.planning.memory",
    "USABLE_FRACTION": "hf_dist_recipes.planning.memory",
    "check_fit": "hf_dist_recipes.planning.fit",
    # `suggest` is also this package's module of that name, which an import binds here over a lazy name.
    "suggest_plans": "hf_dist_recipes.planning.suggest:suggest",
    "render_candidates": "hf_dist_recipes.planning.suggest",
    "compact_rows": "hf_dist_recipes.planning.suggest",
    "reasons": "hf_dist_recipes.planning.suggest",
    "write_configs": "hf_dist_recipes.planning.generate",
    "lint_file": "hf_dist_recipes.planning.lint",
}

__all__ = list(_PUBLIC)

__getattr__ = lazy_names(__name__, _PUBLIC)
