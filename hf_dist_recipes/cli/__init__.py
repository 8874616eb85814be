"""The `hf-dist-recipes` command: one module per subcommand, each building data first and rendering it second."""
