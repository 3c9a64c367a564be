"""Partial-sleep generation benchmark (routing overhead, preemption latency, goodput)."""
