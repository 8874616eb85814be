"""The main job: a small DeepSeek-V3-style model trained with RecipeTrainer under DeepSpeed ZeRO-3."""
