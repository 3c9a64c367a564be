"""The coordinator service: Ray actors that run the pure core (see docs/coordinator.md)."""
