"""Is this environment sound for distributed training? Facts, known-bad rules, the doctor, pins and images.

One module per concept, imported directly (this package imports nothing, so `hf-dist-recipes doctor` pays only
for what it uses): `probe` collects the facts (versions, driver, GPUs, links, /dev/shm, environment variables),
`doctor` turns them into checks, `rules` holds the known-bad version and hardware combinations.
"""
