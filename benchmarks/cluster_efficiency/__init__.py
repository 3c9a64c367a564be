"""Cluster-efficiency benchmark (simulator): see run.py."""
