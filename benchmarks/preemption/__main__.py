"""``python -m benchmarks.preemption``: see run.py."""

from benchmarks.preemption.run import main

if __name__ == "__main__":  # vLLM spawns engine processes that re-import the main module
    main()
