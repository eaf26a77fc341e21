"""weightgeom.optim (see docs/ARCHITECTURE.md)."""
