"""Before `hetpipe worker` starts anything: its --vw is one of the config's virtual workers. Imports no torch,
so a refusal comes at once (a loaded machine took over 25 s to import it first)."""

from __future__ import annotations

from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.errors import UsageError
from hetpipe.core.planning.cluster import allocate

__all__ = ["check_vw_index", "vw_count"]


def vw_count(config: ClusterConfig) -> int:
    """How many virtual workers the config makes: those it lists, or its allocation policy's groups."""
    if config.allocation.policy != "explicit":
        return len(allocate(config, config.allocation.policy))
    return len(config.virtual_workers)


def check_vw_index(config: ClusterConfig, vw: int) -> None:
    """UsageError when `vw` is not one of the config's virtual workers."""
    count = vw_count(config)
    if not 0 <= vw < count:
        raise UsageError(
            f"--vw {vw} is out of range: {config.path} has {count} virtual workers (0..{count - 1})"
        )
