"""``rlix-plugins coordinator``'s arguments are checked before anything starts."""

from __future__ import annotations

import argparse

import pytest

from rlix_plugins.coordinator import coordinator_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlix-plugins coordinator")
    coordinator_cli.add_arguments(parser)
    return parser


@pytest.mark.parametrize("flag", ["--nodes", "--gpus-per-node"])
@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_a_topology_that_is_not_a_positive_count_is_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --nodes 0 used to be read as "not given" (the topology then came from Ray).
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["start", flag, value])
    assert exit_.value.code == 2
    assert "expected an integer >= 1" in capsys.readouterr().err or value == "x"


def test_a_positive_topology_is_read() -> None:
    args = _parser().parse_args(["start", "--nodes", "2", "--gpus-per-node", "8"])
    assert (args.nodes, args.gpus_per_node) == (2, 8)
