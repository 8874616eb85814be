"""The shared layer every practice uses, each mechanism once: reading users' files (`jsonfile`), naming the
setting a checked value came from (`user_values`), findings with their status, exit codes, table, JSON and schemas
(`findings`). Modules are imported directly; this package imports nothing."""
