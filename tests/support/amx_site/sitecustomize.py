"""Test environment: every Python process started with this directory on PYTHONPATH (vLLM
engine cores and workers, Ray workers) requests the AMX tile state first
(:mod:`rlix_amx_request`); tests/conftest.py puts it there."""

import rlix_amx_request  # noqa: F401  (the request runs at import)
