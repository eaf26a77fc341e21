"""weightgeom.analysis (see docs/ARCHITECTURE.md)."""
