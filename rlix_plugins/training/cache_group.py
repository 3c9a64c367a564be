"""The cache owner's own Ray concurrency group: weight syncs are served while the owner trains.

The weight cache lives in one training rank's process (NeMo RL's Megatron rank 0, veRL's actor
rank 0), whose Ray actor runs each training step as one long task. Ray runs an actor's calls
in its default group one at a time (an async actor's synchronous method blocks its event
loop), so a sync asked for while the pipeline trained waited for the rest of the step: the
coordinator waking one of the pipeline's shards on GPUs another pipeline had just released
(async GRPO generates while it trains) held its cycle, and every other pipeline's grants,
that long, and a step longer than the resize timeout failed the wake and fenced the pipeline.

The cache is CPU memory and thread-safe (a version being served is pinned; a build of the
next version only adds one), so serving it needs nothing the training step uses. The methods
that serve it run in :data:`CACHE_GROUP` instead: declare the group on the actor class
(:func:`cache_group_actor`) and tag the methods (:func:`in_cache_group`).

Ray checks the pair: a tagged method on a class declared without the group fails when the
actor class is made (an assertion), and a call sent to a group the actor lacks kills the
actor, so callers never pick the group per call; the tag on the method decides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import ray

#: the group's name on the cache owner's actor
CACHE_GROUP: Final = "rlix_cache"
#: calls served at once in the group: a latest-version query is not held behind a long sync,
#: and syncs to different shards may overlap, as they could on an async owner before
CACHE_GROUP_CONCURRENCY: Final = 4

_F = TypeVar("_F", bound=Callable[..., Any])


def cache_group_options() -> dict[str, Any]:
    """``ray.remote`` keyword arguments declaring :data:`CACHE_GROUP` (``ray.remote`` only:
    Ray refuses ``concurrency_groups`` in ``.options()``)."""
    return {"concurrency_groups": {CACHE_GROUP: CACHE_GROUP_CONCURRENCY}}


def cache_group_actor(cls: type, **remote_options: Any) -> Any:
    """``ray.remote(cls)`` with :data:`CACHE_GROUP` declared (and ``remote_options``)."""
    # ray.remote's typed overloads leave out ``concurrency_groups``, a documented option
    remote: Any = ray.remote
    return remote(**cache_group_options(), **remote_options)(cls)


def in_cache_group(fn: _F) -> _F:
    """Run actor method ``fn`` in :data:`CACHE_GROUP` (its class must declare the group)."""
    tagged: _F = ray.method(concurrency_group=CACHE_GROUP)(fn)
    return tagged


def runs_in_cache_group(fn: object) -> bool:
    """Whether ``fn`` is tagged with :data:`CACHE_GROUP`."""
    return getattr(fn, "__ray_concurrency_group__", None) == CACHE_GROUP


__all__ = [
    "CACHE_GROUP",
    "CACHE_GROUP_CONCURRENCY",
    "cache_group_actor",
    "cache_group_options",
    "in_cache_group",
    "runs_in_cache_group",
]
