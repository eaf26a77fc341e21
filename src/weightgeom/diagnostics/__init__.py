"""weightgeom.diagnostics (see docs/ARCHITECTURE.md)."""
