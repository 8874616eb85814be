"""The shared layer every practice uses, each mechanism once: reading users' files (`jsonfile`) and naming the
setting a checked value came from (`user_values`). Modules are imported directly; this package imports nothing."""
