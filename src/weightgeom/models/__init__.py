"""weightgeom.models (see docs/ARCHITECTURE.md)."""
