"""What touches the world: the cffi CalRT driver, threads, CLI."""
