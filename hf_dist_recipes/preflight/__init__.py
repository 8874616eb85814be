"""`hf-dist-recipes preflight`: about a minute on the real machines, with the real launch config, before the big job.

`result` holds the report's data (checks, statuses, exit code, JSON schema); the launched worker runs the checks on
every rank from the pieces the package already has (doctor, fingerprint, backend policy, commbench, RecipeTrainer
with its gradient-health and seed checks, checkpoint resume, `logs summarize`), and `cli/preflight.py` launches it
with the user's accelerate YAML and renders the report.
"""
