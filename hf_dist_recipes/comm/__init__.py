"""Practice 2: NCCL for GPU communication, and knowing that it works.

`backend` picks and enforces the process-group backend (NCCL on GPUs, never a silent Gloo), `nccl_defaults` sets
hang-proof NCCL environment defaults, `nccl_net` says which network ports NCCL would use, `watchdog` ends every rank
within a bound when one dies, and `commbench` (with `commbench_launch` and `commbench_render`) measures collectives
with the real backend. Modules are imported directly; this package imports nothing."""
