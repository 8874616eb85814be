"""Practice 7 offline: reading a finished (or crashed) run's TensorBoard event files and per-rank summaries, and folding
them into cross-rank findings and a report (`logs summarize`). `events` reads the files (`record_scan`: framing, and
the plain scalar events decoded with numpy; `read_run`: one run directory as TensorBoard's EventAccumulator shows it,
what `monitoring.read_scalars` / `read_texts` return), `aggregate` folds them and writes the aggregate run
(`core.event_writer`, the writer the per-rank runs use too), `report` writes report.md with plots, `summary` reads
the per-rank summaries. Nothing here imports transformers or torch.distributed (tests/unit/test_one_way_imports.py
checks it in a fresh interpreter)."""
