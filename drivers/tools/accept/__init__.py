"""drivers/tools/accept: see docs/architecture.md."""
