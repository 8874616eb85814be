"""Practice 1 inside a training rank: what the arguments apply to this process's environment and check in it.

`cuda_host` (GPUs torch cannot use: stop), `precision` (bf16 where supported), `alloc_defaults` (the CUDA allocator
setting), `extensions` (DeepSpeed's ops built in a node-local folder), `fingerprint` (every rank's versions compared
before training). The doctor, the probe of the machine, the known-bad rules and `pin` run from the command line:
`hf_dist_recipes.doctor`, which imports this folder, never the other way. Modules are imported directly; this
package imports nothing.
"""
