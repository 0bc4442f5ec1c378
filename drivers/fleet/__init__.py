"""drivers/fleet: see docs/architecture.md."""
