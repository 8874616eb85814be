"""Practice 2: NCCL for GPU communication, and knowing that it works.

`backend` picks and enforces the process-group backend (NCCL on GPUs, never a silent Gloo), `nccl_defaults` sets
hang-proof NCCL environment defaults, `watchdog` ends every rank within a bound when one dies, and `commbench` (with
`commbench_launch` and `commbench_render`) measures collectives with the real backend. Which network ports NCCL would
use is a fact of the host: `doctor.nccl_net`. Modules are imported directly; this package imports nothing."""
