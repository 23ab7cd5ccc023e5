"""Exceptions a user can act on: each carries its remedy and the exit code the CLI uses for it."""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Iterable

__all__ = ["ConfigError", "HetpipeError", "UsageError", "WriteError", "did_you_mean"]


class HetpipeError(Exception):
    """A failure with a message a user can act on; the CLI prints it without a traceback."""

    exit_code = 1


class ConfigError(HetpipeError):
    """A cluster config that cannot be used: the message names the file, field, bad value and fix."""

    exit_code = 2


class WriteError(HetpipeError):
    """A file that could not be written (a full disk, a lost mount, permissions): names the errno and path."""

    errno: int | None = None  # the OSError's

    @classmethod
    def of(cls, path: object, exc: OSError) -> WriteError:
        code = errno.errorcode.get(exc.errno or 0, "")
        reason = f"{exc.strerror or exc} ({code})" if code else str(exc.strerror or exc)
        fix = (
            "free space there (a run with checkpoints then goes on with `hetpipe train --resume RUN_DIR`), "
            "or give the run a dir on another disk (--run-dir, train.out_dir; `hetpipe server`: "
            "checkpoint.dir)"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "check that the directory exists and is writable"
        )
        error = cls(f"cannot write {os.fspath(path)}: {reason}; {fix}")  # type: ignore[arg-type]
        error.errno = exc.errno
        return error


class UsageError(HetpipeError):
    """Arguments that do not fit together."""

    exit_code = 2


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """' (did you mean "x"?)' for the closest of `choices` (case-insensitive), or "" when none is close; the
    one choice that starts with `word` (at least 3 characters: "1f1b" for "1f1b-flush") counts as close."""
    by_lower = {choice.lower(): choice for choice in choices}
    starting = [c for c in by_lower if len(word) >= 3 and c.startswith(word.lower())]
    close = (
        starting
        if len(starting) == 1
        else difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=cutoff)
    )
    return f' (did you mean "{by_lower[close[0]]}"?)' if close else ""
