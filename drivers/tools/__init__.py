"""drivers/tools: see docs/architecture.md."""
