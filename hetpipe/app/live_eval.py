"""Evaluation of the global weights while a run trains (`train.eval_every` waves): a thread of the launcher
reads the PS's newest weights W_t, scores them on held-out data on a training device, and hands the result
to the launcher, which writes it into metrics.jsonl as an "eval" event (wave = t)."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from typing import Any

import torch

from hetpipe.compute.build import dataset_of
from hetpipe.compute.data import DatasetSplit
from hetpipe.compute.evaluate import evaluate
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.protocol.keys import ClientKeys
from hetpipe.models import ModelSpec
from hetpipe.worker.ps_client import PSClient

__all__ = ["LiveEvaluator"]

NICE = 10  # the evaluation thread's niceness: it takes the CPU the stages leave (emulated stages sleep often)


class LiveEvaluator:
    """Scores W_t each time c_global passes a multiple of eval_every (not at the end: the final evaluation
    covers it); one evaluation at a time, so a slow one skips a due point rather than queueing behind it.

    The held-out data is loaded by the evaluation thread at its first evaluation, never on the launcher's
    path to the first minibatch. On the CPU the evaluation runs in the launcher's torch threads: the launcher
    keeps them at one while stages train there (hetpipe.app.train), and on Linux the thread runs at nice
    NICE, so it takes what CPU the stages leave rather than slowing them.
    """

    def __init__(
        self,
        config: ClusterConfig,
        spec: ModelSpec,
        endpoints: list[str],
        num_vws: int,
        device: str,
        admin_keys: ClientKeys | None = None,
    ) -> None:
        self.config, self.spec, self.endpoints, self.num_vws, self.device = (
            config,
            spec,
            endpoints,
            num_vws,
            device,
        )
        self.admin_keys = admin_keys
        self.every = config.train.eval_every
        self.results: queue.Queue[dict[str, Any]] = queue.Queue()
        self._next = self.every
        self._busy: threading.Thread | None = None
        self._data: DatasetSplit | None = None

    def wave_done(self, c_global: int) -> None:
        """Called with every VW's completed waves; starts an evaluation when one is due and none runs."""
        if not self.every or c_global < self._next or c_global >= self.config.train.waves:
            return
        if self._busy is not None and self._busy.is_alive():
            return
        self._next = (c_global // self.every + 1) * self.every
        self._busy = threading.Thread(target=self._score, args=(c_global,), name="live-eval", daemon=True)
        self._busy.start()

    def _score(self, c_global: int) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: this thread only, below the stages
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        try:
            with PSClient(
                self.endpoints,
                self.config.name,
                0,
                0,
                self.num_vws,
                1,
                {},
                timeout_s=60,
                retry_s=5,
                curve=self.admin_keys,
            ) as ps:
                version, weights = ps.snapshot()
            read_at = time.time()
            started = time.perf_counter()
            if self._data is None:
                self._data = dataset_of(self.config)
            state = {k: torch.from_numpy(v) for k, v in weights.items() if not k.startswith("audit/")}
            scores = evaluate(
                self.spec, state, self._data, device=self.device, max_samples=self.config.train.eval_samples
            )
            self.results.put(
                {
                    "event": "eval",
                    "wave": version,
                    "c_global": c_global,
                    "time": read_at,
                    "eval_s": round(time.perf_counter() - started, 3),
                    **scores,
                }
            )
        except Exception as exc:  # a failed evaluation must not stop training; say so in the metrics
            self.results.put(
                {
                    "event": "eval_failed",
                    "wave": c_global,
                    "time": time.time(),
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )

    def join(self, timeout_s: float = 30.0) -> None:
        if self._busy is not None:
            self._busy.join(timeout_s)
