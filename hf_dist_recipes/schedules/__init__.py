"""Practice 6: linear warm-up, then cosine annealing with hard restarts (`warmup_cosine`). Modules are imported
directly; this package imports nothing."""
