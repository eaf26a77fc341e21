"""weightgeom.manifolds (see docs/ARCHITECTURE.md)."""
