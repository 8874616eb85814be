"""Practice 4: seed every rank the same way (`seeding`), and prove while the job runs that the ranks agree on what
must agree (`rank_agreement`). Modules are imported directly; this package imports nothing."""
