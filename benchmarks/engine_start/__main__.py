"""``python -m benchmarks.engine_start``: see run.py."""

from benchmarks.engine_start.run import main

if __name__ == "__main__":  # vLLM spawns engine processes that re-import the main module
    main()
