"""Which host jobs the coordinator can time-share: rules over a job's config, checked before
the host builds anything (NeMo RL: :mod:`.nemo_rl_support`, veRL: :mod:`.verl_support`).

A rule names one setting (a dotted key), what is valid and why. :func:`unsupported` returns
every setting that breaks a rule, so one error names them all (a user fixes the config once,
not once per failed launch). Pure: reads mappings (dicts, OmegaConf's ``DictConfig``) and
attribute objects (pydantic models) alike; no host import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from rlix_plugins.errors import UnsupportedJobError


class _Unset:
    """A setting absent from the config."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"


#: What :func:`lookup` returns for an absent setting (shown as ``<unset>``).
UNSET: Final = _Unset()


@dataclass(frozen=True, slots=True)
class JobProblem:
    """One setting of a job the coordinator cannot time-share."""

    key: str
    found: object
    valid: str
    why: str

    def describe(self) -> str:
        return f"{self.key}={self.found!r} (valid: {self.valid}): {self.why}"


@dataclass(frozen=True, slots=True)
class JobRule:
    """``key`` must satisfy ``accepts``; ``valid`` and ``why`` are what the error says."""

    key: str
    accepts: Callable[[object], bool]
    valid: str
    why: str


def is_true(value: object) -> bool:
    """Exactly ``True`` (a ``"true"`` string is no boolean)."""
    return value is True


def is_false(value: object) -> bool:
    return value is False


def is_false_or_unset(value: object) -> bool:
    return value is False or value is None or value is UNSET


def is_none_or_unset(value: object) -> bool:
    return value is None or value is UNSET


def equals(expected: str) -> Callable[[object], bool]:
    def accepts(value: object) -> bool:
        return isinstance(value, str) and value == expected

    return accepts


def differs_from(refused: str) -> Callable[[object], bool]:
    """Unset, or any string but ``refused`` (the host validates the rest itself)."""
    def accepts(value: object) -> bool:
        return value is UNSET or (isinstance(value, str) and value != refused)

    return accepts


def lookup(config: object, dotted: str) -> object:
    """``config``'s value at ``a.b.c``, through mappings and attributes; :data:`UNSET` when
    any part is absent."""
    node: object = config
    for part in dotted.split("."):
        if isinstance(node, Mapping):
            if part not in node:
                return UNSET
            node = node[part]
        elif node is not None and not isinstance(node, (str, bytes)) and hasattr(node, part):
            node = getattr(node, part)
        else:
            return UNSET
    return node


def unsupported(config: object, rules: Iterable[JobRule]) -> list[JobProblem]:
    """The rules ``config`` breaks, in the rules' order."""
    return [
        JobProblem(rule.key, found, rule.valid, rule.why)
        for rule in rules
        if not rule.accepts(found := lookup(config, rule.key))
    ]


def raise_if_unsupported(host: str, problems: Iterable[JobProblem]) -> None:
    """Raise :class:`~rlix_plugins.errors.UnsupportedJobError` naming every problem (``host``:
    e.g. "NeMo RL"); return when there is none."""
    found = tuple(problems)
    if not found:
        return
    lines = "\n".join(f"  - {p.describe()}" for p in found)
    raise UnsupportedJobError(
        f"rlix: this {host} job cannot be time-shared under RLIX_CONTROL_PLANE=rlix (refused "
        "before any worker was started or GPU claimed; unset RLIX_CONTROL_PLANE to run it "
        "unchanged, or change):\n" + lines,
        found,
    )


__all__ = ["UNSET", "JobProblem", "JobRule", "differs_from", "equals", "is_false",
           "is_false_or_unset", "is_none_or_unset", "is_true",
           "lookup", "raise_if_unsupported", "unsupported"]
