"""Hook protocol between a host training loop and the coordinator."""

from rlix_plugins.hooks.protocol import NoOpRLixHooks, RLixHooks

__all__ = ["NoOpRLixHooks", "RLixHooks"]
