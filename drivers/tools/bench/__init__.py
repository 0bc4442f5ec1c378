"""drivers/tools/bench: see docs/architecture.md."""
