"""weightgeom.data (see docs/ARCHITECTURE.md)."""
