"""Practice 6: linear warm-up, then cosine annealing with hard restarts (`warmup_cosine`), and its settings in the
arguments (`scheduler_kwargs`)."""

from hf_dist_recipes.core.public_names import lazy_names

# The names a notebook or a script uses; everything else in the package's modules is internal (core.public_names).
_PUBLIC = {
    "WarmupCosineRestarts": "hf_dist_recipes.schedules.warmup_cosine",
}

__all__ = list(_PUBLIC)

__getattr__ = lazy_names(__name__, _PUBLIC)
