"""weightgeom.experiments (see docs/ARCHITECTURE.md)."""
