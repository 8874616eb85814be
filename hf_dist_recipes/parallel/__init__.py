"""Practice 3 inside a training rank: ZeRO-3 with tensor (and expert) parallelism, as the running job sees it.

What `RecipeTrainingArguments` and `RecipeTrainer` import (the planning side, which writes and checks the files, is
`hf_dist_recipes.planning`, and imports this folder, never the other way): batch (the global batch under TP),
construction (unpartitioned ZeRO-3 models stopped), checkpoint_bytes (bytes of one save, its timeout), plan_record
(the plan recorded in the DeepSpeed JSON, read back and held to), chunked_loss (the training loss a chunk of tokens at
a time, which the estimate counts as one chunk's logits); and the plan with its estimate, which a rank runs
too: plan.ParallelPlan (the job and its rules) -> models (shapes, exact counts; the demo's model templates) ->
tp_specs (what TP splits) -> elements, zero_buffers -> memory (per-rank estimate, quoted when a rank stops on the
recorded plan).
"""
