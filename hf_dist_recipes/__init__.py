"""hf-dist-recipes: distributed training of DeepSeek-style LLMs with transformers, accelerate and DeepSpeed,
with the seven practices as enforced defaults.

The public names are imported on first use, so that `hf-dist-recipes --help` does not pay for importing the Trainer.
"""

from importlib import import_module

_PUBLIC = {
    "RecipeTrainer": "hf_dist_recipes.trainer",
    "RecipeTrainerMixin": "hf_dist_recipes.trainer",
    "recipe": "hf_dist_recipes.trainer_classes",
    "RecipeTrainingArguments": "hf_dist_recipes.arguments",
    "recipe_arguments": "hf_dist_recipes.arguments",
    "ExpertBiasBalancer": "hf_dist_recipes.moe.expert_balance",
    "GradientHealthCallback": "hf_dist_recipes.stability.gradient_health",
    "RankAgreementCallback": "hf_dist_recipes.reproducibility.rank_agreement",
    "RecipeCallback": "hf_dist_recipes.runtime",
    "RecipeRuntime": "hf_dist_recipes.runtime",
    "ParallelPlan": "hf_dist_recipes.planning.plan",
    "SeedReport": "hf_dist_recipes.reproducibility.seeding",
    "seed_everything": "hf_dist_recipes.reproducibility.seeding",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name == "__version__":
        # Looked up on first use: importlib.metadata costs ~0.08 s of every command's start-up otherwise.
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("hf-dist-recipes")
        except PackageNotFoundError:  # running from a source tree that was never installed
            value = "0+unknown"
        globals()["__version__"] = value
        return value
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hf_dist_recipes' has no attribute {name!r}")
