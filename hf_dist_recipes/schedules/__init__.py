"""Practice 6: linear warm-up, then cosine annealing with hard restarts (`warmup_cosine`), and its settings in the
arguments (`scheduler_kwargs`). Modules are imported directly; this package imports nothing."""
