"""Practice 3 inside a training rank: ZeRO-3 with tensor (and expert) parallelism, as the running job sees it.

What `RecipeTrainingArguments` and `RecipeTrainer` import (the planning side, which writes and checks the files, is
`hf_dist_recipes.planning`, and imports this folder, never the other way): batch (the global batch under TP),
construction (unpartitioned ZeRO-3 models stopped), checkpoint_bytes (bytes of one save, its timeout), plan_record
(the plan recorded in the DeepSpeed JSON, read back and held to; the memory figures a rank quotes are recorded there by
`config generate`, so no rank imports the estimate), chunked_loss (the training loss a chunk of tokens at a time,
which the estimate counts as one chunk's logits), sequence_parallel (Ulysses SP under the recipe: MLA, CPU, positions,
evaluation), tiled_mlp (the gated MLPs a slice of the tokens at a time).
"""
