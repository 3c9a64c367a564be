"""Request-migration benchmark of the generation router (migration on vs off)."""
