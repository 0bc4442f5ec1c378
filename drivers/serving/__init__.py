"""drivers/serving: see docs/architecture.md."""
