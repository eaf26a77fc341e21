"""weightgeom.train (see docs/ARCHITECTURE.md)."""
