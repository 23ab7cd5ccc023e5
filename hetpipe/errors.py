"""Exceptions a user can act on: each carries its remedy and the exit code the CLI uses for it."""

from __future__ import annotations

__all__ = ["HetpipeError", "ConfigError", "UsageError"]


class HetpipeError(Exception):
    """A failure with a message a user can act on; the CLI prints it without a traceback."""

    exit_code = 1


class ConfigError(HetpipeError):
    """A cluster config that cannot be used: the message names the file, field, bad value and fix."""

    exit_code = 2


class UsageError(HetpipeError):
    """Arguments that do not fit together."""

    exit_code = 2
