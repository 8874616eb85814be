"""Is this environment sound for distributed training? Facts, known-bad rules, the doctor, pins and images.

One module per concept, imported directly (this package imports nothing, so `hf-dist-recipes doctor` pays only
for what it uses): `probe` (with `probe_gpus`, `probe_nccl`) collects the facts (versions, driver, GPUs, links,
/dev/shm, environment variables) into the dataclasses of `facts`, `doctor_checks` judges them, `doctor` assembles the
report (`nccl_net`: the network ports NCCL would pick from these facts), `rules` (with `rule_conditions`) holds the
known-bad version and hardware combinations.
"""
