"""``python -m benchmarks.router_migration``: see run.py."""

from benchmarks.router_migration.run import main

if __name__ == "__main__":  # vLLM spawns engine processes that re-import the main module
    main()
