"""coordinator/core."""
