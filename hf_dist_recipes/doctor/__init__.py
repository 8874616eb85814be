"""Practice 1 from the command line: is this environment sound for distributed training? Facts, known-bad rules, the
doctor, pins and images (`hf-dist-recipes doctor`, `pin`, and `preflight`'s environment check). No training rank
imports this folder.

One module per concept, imported directly (this package imports nothing, so `hf-dist-recipes doctor` pays only
for what it uses): `probe` (with `probe_gpus`, `probe_nccl`) collects the facts (versions, driver, GPUs, links,
/dev/shm, environment variables) into the dataclasses of `facts`, `doctor_checks` judges them, `doctor` assembles the
report (`nccl_net`: the network ports NCCL would pick from these facts; `op_builds`: a stale DeepSpeed build lock,
the ninja builds use), `rules` (with `rule_conditions`) holds the known-bad version and hardware combinations,
`lock`, `torch_builds`, `dockerfile` and `pin` write and read the pins.
"""
