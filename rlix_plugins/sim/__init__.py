"""Discrete-event cluster simulator on the production scheduling core (no Ray, virtual time).

Entry points: :func:`rlix_plugins.sim.runner.run_policy` (one policy, one workload),
:func:`rlix_plugins.sim.report.compare` (every policy, same seed, JSON + PNG) and
``rlix-plugins simulate`` (:mod:`rlix_plugins.sim.simulate_cli`). See docs/simulator.md.
"""
