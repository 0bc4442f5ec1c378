"""drivers/synthetic: see docs/architecture.md."""
