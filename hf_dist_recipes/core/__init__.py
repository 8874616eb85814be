"""The shared layer every practice uses, each mechanism once: reading users' files (`jsonfile`), naming the
setting a checked value came from (`user_values`), findings with their status, exit codes, table, JSON and schemas
(`findings`), one value from every rank (`gather`), which ranks form the TP / data-parallel groups (`layout`), the one
size grammar (`sizes`), TensorBoard event files written (`event_writer`: the per-rank runs live, the aggregate run
offline; `crc32c`, their checksums, read back by logs/ too). Modules are imported directly; this package imports
nothing."""
