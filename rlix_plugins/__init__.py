"""rlix-plugins: GPU time-sharing for NeMo RL and veRL jobs under an RLix-compatible coordinator.

Importing this package has no side effects. Host patches are applied by
:mod:`rlix_plugins.activation` only when ``RLIX_CONTROL_PLANE=rlix``.
"""

__version__ = "0.1.0"
