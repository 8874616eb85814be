"""hf-dist-recipes: distributed training of DeepSeek-style LLMs with transformers, accelerate and DeepSpeed,
with the seven practices as enforced defaults."""

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.seeding import SeedReport, seed_everything
from hf_dist_recipes.trainer import RecipeTrainer

__version__ = "0.1.0"

__all__ = ["RecipeTrainer", "RecipeTrainingArguments", "SeedReport", "seed_everything", "__version__"]
