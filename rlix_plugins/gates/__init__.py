"""Validation gates 1-3: what a user runs to trust the package (see docs/gates.md)."""
