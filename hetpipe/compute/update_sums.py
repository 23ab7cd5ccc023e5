"""A stage's own updates per wave (docs/wsp.md): the lazy fold of updates into sums, what PUSH sends of them,
and the rebase of the tracked tensors after a pull. No forwards, no optimizer, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from hetpipe.compute.multi_tensor import add_into

__all__ = ["UpdateSums", "host_for"]

Sums = dict[int, dict[str, Tensor]]


class UpdateSums:
    """Own update sums per wave, kept until a pull contains them, and the baseline the next change is taken
    from; with aggregation server, the gradient sums per wave instead (the PS runs the optimizer).

    An update of a wave is recorded lazily: the updates of one wave since the baseline are folded in at once,
    Δ = t - baseline; sums[wave] += Δ; baseline = t, when an update of another wave comes and before PUSH and
    WAIT, or at each update where `observe` needs each update's Δ (mitigations)."""

    def __init__(
        self,
        tracked: dict[str, Tensor],
        params: Mapping[str, Tensor],
        average: int,
        observe: Callable[[list[str], list[Tensor]], None] | None,
        host: torch.device | None = None,
    ) -> None:
        """`tracked`: the tensors updates are recorded for; `params`: the stage's parameters (`average` > 0:
        the rebase adds their own sums as sums[w] / average); `observe(keys, deltas)`: each update's change,
        before it is summed; `host`: where `keep_pushed` moves the sums of pushed waves (None: they stay with
        the tracked tensors)."""
        self.tracked = tracked
        self._params = params
        self._average = average
        self._observe = observe
        self._host = host
        self._kept: torch.cuda.Event | None = None  # CUDA: the last device-to-host copy of kept sums
        self.baseline = {k: t.detach().clone() for k, t in tracked.items()}
        self.sums: Sums = {}  # own update sums per wave, until a pull contains them
        self.gsums: Sums = {}  # aggregation server: gradient sums per wave
        self.open_wave: int | None = None  # the wave whose updates since the baseline are not in sums yet

    def reset_baseline(self) -> None:
        """The tracked tensors were set from outside (e.g. to W_0): they are the baseline, no update open."""
        self.baseline = {k: t.detach().clone() for k, t in self.tracked.items()}
        self.open_wave = None

    # ---- recording --------------------------------------------------------------------------------------
    def record(self, wave: int) -> None:
        """Note an update of `wave`: folded into the sums with the wave's other updates (one subtraction, add
        and copy for all of them, since on CUDA a stage's host time per minibatch is what it must keep under
        the device's), or at once where a mitigation needs each update's change."""
        if self.open_wave is not None and self.open_wave != wave:
            self.fold()
        self.open_wave = wave
        if self._observe is not None:
            self.fold()

    @torch.no_grad()
    def fold(self) -> None:
        """Add what the updates since the baseline changed (tracked - baseline) to their wave's sums and move
        the baseline, over all tensors at once (torch._foreach_*)."""
        wave, self.open_wave = self.open_wave, None
        keys = list(self.tracked)
        if wave is None or not keys:
            return
        now = [self.tracked[k] for k in keys]
        deltas = torch._foreach_sub(now, [self.baseline[k] for k in keys])
        sums = self.sums.setdefault(wave, {})
        if self._observe is not None:
            self._observe(keys, deltas)
        add_into(sums, list(zip(keys, deltas, strict=True)))
        torch._foreach_copy_([self.baseline[k] for k in keys], now)

    def add_gradients(self, wave: int, acc: Mapping[str, Tensor]) -> None:
        """Aggregation server: gsums[wave] += acc (the mean gradient of an update)."""
        gsum = self.gsums.setdefault(wave, {})
        for key, g in acc.items():
            if key in gsum:
                gsum[key] += g
            else:
                gsum[key] = g.clone()

    # ---- PUSH and WAIT ----------------------------------------------------------------------------------
    @torch.no_grad()
    def push(self, wave: int) -> dict[str, Tensor]:
        """The update sums PUSH `wave` sends, by tracked key (zeros for a wave without an update)."""
        self.fold()
        if (
            wave not in self.sums
        ):  # a wave without an update (not setdefault: its zeros would be made every time)
            self.sums[wave] = {k: torch.zeros_like(t) for k, t in self.tracked.items()}
        sums = self.sums[wave]
        return {k: sums[k] for k in self.tracked}

    @torch.no_grad()
    def mean_gradients(self, wave: int, params: Mapping[str, Tensor], nm: int) -> dict[str, Tensor]:
        """Aggregation server: the mean gradient PUSH `wave` sends per parameter, gsums[wave] / nm (zeros for
        a parameter without one); the wave's gradient sums are dropped."""
        gsum = self.gsums.pop(wave, {})
        out: dict[str, Tensor] = {}
        for key, param in params.items():
            g = gsum.get(key)
            out[key] = torch.zeros_like(param) if g is None else g / nm
        return out

    def forget(self, through: int, pushed: int | None = None) -> None:
        """Drop own update sums of waves <= through (a pull contains them, or no pull will ever come); with
        `pushed`, move those of waves <= pushed that remain to `host` (keep_pushed)."""
        for wave in [w for w in self.sums if w <= through]:
            del self.sums[wave]
        if pushed is not None:
            self.keep_pushed(pushed)

    @torch.no_grad()
    def keep_pushed(self, through: int) -> None:
        """Move the own sums of waves <= through (pushed: no update changes them any more) to `host`, so that
        a stage's device holds only the sums of the wave in progress (docs/memory.md#what-a-stage-keeps). From
        a CUDA device into pinned memory, queued in stream order: the rebase's copy back is queued after it,
        and `settle` waits for it before the host reads them."""
        if self._host is None:
            return
        moved = False
        for wave, sums in self.sums.items():
            if wave > through or wave == self.open_wave:
                continue
            for key, t in sums.items():
                if t.device != self._host:
                    sums[key] = _to_host(t, self._host)
                    moved = moved or t.is_cuda
        if moved:
            self._kept = torch.cuda.Event()
            self._kept.record()

    def settle(self) -> None:
        """Block until the sums `keep_pushed` moved have arrived (before the host reads them: checkpoints)."""
        if self._kept is not None:
            self._kept.synchronize()
            self._kept = None

    @torch.no_grad()
    def rebase(self, pulled: Mapping[str, Tensor], own_through: int) -> None:
        """tracked = pulled + own update sums of waves > own_through, added in wave order (average: parameter
        sums / VWs); the result is the new baseline. A key the pull did not bring (frozen: its value is the
        one it froze at, with no own updates since) is left as it is."""
        self.fold()
        self.forget(own_through)
        keys = [k for k in self.tracked if k in pulled]
        if keys:  # per tensor: t = pulled, then t += each wave's own sum in wave order; all tensors at once
            now = [self.tracked[k] for k in keys]
            torch._foreach_copy_(now, [pulled[k] for k in keys])
            for wave in sorted(self.sums):
                # a kept wave's sums come back from the host one wave at a time (in stream order on CUDA);
                # averaged, each tensor's copy is divided as it comes, not all copied first
                own = [self._own(self.sums[wave][k], k, t.device) for k, t in zip(keys, now, strict=True)]
                torch._foreach_add_(now, own)
            torch._foreach_copy_([self.baseline[k] for k in keys], now)

    def _own(self, part: Tensor, key: str, device: torch.device) -> Tensor:
        """A sum's part as the rebase adds it: on `device`, / average for a parameter when averaging."""
        on_device = part.to(device, non_blocking=True)
        return on_device / self._average if self._average and key in self._params else on_device


def host_for(tracked: Mapping[str, Tensor], staleness: int) -> torch.device | None:
    """Where a stage keeps the sums of pushed waves: host memory for CUDA tensors at D >= 1 (D + 1 pushed
    waves' sums wait for their pull there, docs/memory.md#what-a-stage-keeps), else None (they stay)."""
    on_cuda = any(t.is_cuda for t in tracked.values())
    return torch.device("cpu") if on_cuda and staleness >= 1 else None


def _to_host(t: Tensor, host: torch.device) -> Tensor:
    """A copy of `t` on `host`: from a CUDA device into pinned memory, queued (not waited for)."""
    if not t.is_cuda:
        return t.to(host, copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, device=host, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
