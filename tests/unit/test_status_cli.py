"""``rlix-plugins status``'s options and its watch loop (no Ray: the status is built by the
real core from a real SchedulerState)."""

from __future__ import annotations

import argparse
import json

import pytest

from rlix_plugins.coordinator.core.status import CoordinatorStatus, build_status
from rlix_plugins.coordinator.status_cli import add_arguments, render, watch
from tests.core_builders import new_state, register


def _status() -> CoordinatorStatus:
    state = new_state()
    register(state, "ft_status000001", train=[0, 1])
    return build_status(state, 0.0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser


def test_watch_shows_count_times_and_sleeps_between() -> None:
    shown: list[CoordinatorStatus] = []
    slept: list[float] = []
    status = _status()
    n = watch(lambda: status, shown.append, every_s=2.5, count=3, sleep=slept.append)
    assert n == 3 and shown == [status] * 3 and slept == [2.5, 2.5]  # no sleep after the last


def test_without_watch_it_shows_once() -> None:
    shown: list[CoordinatorStatus] = []
    assert watch(_status, shown.append, every_s=None, count=None,
                 sleep=lambda s: pytest.fail("slept")) == 1


def test_a_failing_fetch_stops_the_watch_with_its_error() -> None:
    def fetch() -> CoordinatorStatus:
        raise TimeoutError("no answer")

    with pytest.raises(TimeoutError):
        watch(fetch, lambda s: None, every_s=1.0, count=None, sleep=lambda s: None)


def test_json_is_one_line_per_record_while_watching() -> None:
    status = _status()
    once = render(status, namespace="rlix", as_json=True, watching=False)
    line = render(status, namespace="rlix", as_json=True, watching=True)
    assert "\n" in once and "\n" not in line and json.loads(once) == json.loads(line)
    text = render(status, namespace="rlix", as_json=False, watching=True)
    assert text.startswith("--- ") and "ft_status000001" in text and "WAIT QUEUE" in text


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["--watch", "0"], "out of range; expected finite seconds > 0"),
        (["--watch", "nan"], "out of range; expected finite seconds > 0"),
        (["--timeout", "-1"], "out of range; expected finite seconds > 0"),
        (["--timeout", "soon"], "not a number; expected seconds > 0"),
        (["--count", "0"], "out of range; expected an integer >= 1"),
        (["--count", "two"], "not an integer; expected >= 1"),
    ],
)
def test_bad_values_are_refused_naming_what_is_valid(argv: list[str], what: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=what):
        _parser().parse_args(argv)


def test_defaults() -> None:
    args = _parser().parse_args([])
    assert (args.watch, args.count, args.timeout, args.json) == (None, None, 30.0, False)

