"""Options the benchmarks share: --testbed, --testbed-scale and --probe-seconds (those that can run in the
testbed), --cached-profile, and the parsing of comma-separated counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def testbed_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add use_testbed, testbed_scale and probe_seconds to a click command (docs/testbed.md)."""
    for option in reversed(
        [
            click.option(
                "--testbed",
                "use_testbed",
                is_flag=True,
                help="Run every system in the shaped-network testbed (root; docs/testbed.md) instead of on a "
                "free network.",
            ),
            click.option(
                "--testbed-scale",
                type=click.FloatRange(min=0, min_open=True),
                default=None,
                help="Link scale in the testbed: links at inter_node_gbps x this (default: derived, "
                "docs/testbed.md).",
            ),
            click.option(
                "--probe-seconds",
                type=click.FloatRange(min=0.5),
                default=1.5,
                show_default=True,
                help="Testbed: seconds each node's egress is measured for, before the systems run.",
            ),
        ]
    ):
        command = option(command)
    return command


def profile_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add `cached_profile` (--cached-profile): by default the CPU profile that the planner and the link scale
    use is measured afresh when the bench starts, since this machine's speed drifts (a profile cached hours
    earlier, at a load of 0.23 per core, made a plan's predicted rate 0.72x the measured one)."""
    return click.option(
        "--cached-profile",
        is_flag=True,
        help="Reuse the cached CPU profile instead of measuring it afresh at the start.",
    )(command)


def parse_ints(text: str, what: str) -> list[int]:
    """Positive integers from "a,b,c"; a click error naming `what` otherwise."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: give {what} as positive integers separated by commas")
    return values
