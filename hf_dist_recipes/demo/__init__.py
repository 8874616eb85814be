"""The main job: a small DeepSeek-V3-style model trained with RecipeTrainer under DeepSpeed ZeRO-3; its model and
data serve a notebook or a first try of your own script on the CPU."""

from hf_dist_recipes.core.public_names import lazy_names

# The names a notebook or a script uses; everything else in the package's modules is internal (core.public_names).
_PUBLIC = {
    "build_tiny_deepseek": "hf_dist_recipes.demo.model",
    "stdlib_dataset": "hf_dist_recipes.demo.data",
}

__all__ = list(_PUBLIC)

__getattr__ = lazy_names(__name__, _PUBLIC)
