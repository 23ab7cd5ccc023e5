"""PS throughput benchmark: one client's push+pull round trips through the PS against raw ZeroMQ.

For each model size and shard count, in the same run, round by round, alternating which goes first:
  ps   - a stage registers a model of SIZE MB (4 MB tensors), then repeats push(wave c) + pull(wave c+2)
         (D = 0, exact pulls; the pull copies the weights into the stage's arrays as a worker does);
  raw  - the same bytes in the same 1 MiB zero-copy frames to S echo servers (ROUTER) that answer with
         the same number of bytes from a preallocated buffer: ZeroMQ loopback with no PS work at all;
  ps_curve (with --auth curve) - the PS as a stage of auth = "curve" talks to it: CurveZMQ encryption, the
         ZAP-admitted key checked on every request; same rounds, same model, interleaved with the other two;
  ps_durable (with --durable N) - the PS checkpointing every N clocks, what lets a crashed shard restart
         without losing an acknowledged push (docs/recovery.md); interleaved likewise;
  ps_bf16 (with --wire bfloat16) - pushes and pulls as bfloat16 on the wire ([ps] wire_dtype): half the
         bytes, packed and widened by numpy on each side; interleaved likewise.
Throughput counts both directions: 2 x SIZE bytes per round trip (the model's float32 bytes for ps_bf16 too,
so its figure is the model's rate, not the wire's).

    python launch/bench/ps_throughput.py [--sizes 10,100,400] [--shards 1,4] [--rounds 5] [--auth curve]
        [--durable N] [--wire bfloat16] [--out FILE] [--plot FILE.png]
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plots  # noqa: E402  (launch/bench is not a package)

from hetpipe.core.protocol import wire  # noqa: E402
from hetpipe.core.protocol.keys import ClientKeys, ServerKeys, client_keys, key_users, server_keys, write_keys  # noqa: E402
from hetpipe.core.protocol.placement import balanced_placement  # noqa: E402
from hetpipe.core.runs.procs import ChildGroup  # noqa: E402
from hetpipe.server.launch import serve_settings  # noqa: E402
from hetpipe.server.shard import ShardSettings  # noqa: E402
from hetpipe.worker.ps_client import PSClient  # noqa: E402

TENSOR_BYTES = 4 << 20


def make_model(size_mb: int) -> dict[str, np.ndarray]:
    total = size_mb * 1_000_000
    n_full, rest = divmod(total, TENSOR_BYTES)
    sizes = [TENSOR_BYTES] * n_full + ([rest - rest % 4] if rest >= 4 else [])
    rng = np.random.default_rng(0)
    return {
        f"layer{i:03d}.weight": rng.standard_normal(n // 4).astype(np.float32) for i, n in enumerate(sizes)
    }


def echo_server(nbytes: int, port_queue) -> None:
    """Raw peer: answer every message with `nbytes` in 1 MiB zero-copy frames from one buffer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    wire.configure_socket(sock, router=True)
    port_queue.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    reply = np.ones(max(nbytes, 1), np.uint8)
    view = memoryview(reply)
    frames = [view[i : i + wire.CHUNK_BYTES] for i in range(0, nbytes, wire.CHUNK_BYTES)]
    while True:
        msg = sock.recv_multipart(copy=False)
        if msg[1].bytes == b"stop":
            break
        sock.send_multipart([msg[0], b"r", *frames], copy=False)
    sock.close()
    ctx.term()


def start(group: ChildGroup, name: str, target, *args) -> int:
    queue = group.ctx.Queue()
    group.start(name, target, *args, queue)
    return queue.get(timeout=60)


class RawPeer:
    """Raw ZeroMQ: the same bytes in the same frames to echo servers, one per shard."""

    def __init__(self, group: ChildGroup, model: dict[str, np.ndarray], shards: int) -> None:
        placement = balanced_placement({k: v.nbytes for k, v in model.items()}, shards)
        parts = [[v for k, v in model.items() if placement[k] == s] for s in range(shards)]
        ports = [
            start(group, f"raw{s}", echo_server, sum(a.nbytes for a in part)) for s, part in enumerate(parts)
        ]
        self.ctx = zmq.Context()
        self.socks = []
        for port in ports:
            sock = self.ctx.socket(zmq.DEALER)
            wire.configure_socket(sock, router=False)
            sock.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(sock)
        self.frames = []
        for part in parts:
            out: list[memoryview] = [memoryview(b"q")]
            for arr in part:
                flat = memoryview(arr).cast("B")
                out += [flat[i : i + wire.CHUNK_BYTES] for i in range(0, arr.nbytes, wire.CHUNK_BYTES)]
            self.frames.append(out)

    def round(self) -> float:
        t0 = time.perf_counter()
        for sock, f in zip(self.socks, self.frames, strict=True):
            sock.send_multipart(f, copy=False)
        for sock in self.socks:
            sock.recv_multipart(copy=False)
        return time.perf_counter() - t0

    def close(self) -> None:
        for sock in self.socks:
            sock.send(b"stop")
            sock.close(linger=1000)
        self.ctx.term()


class PsPeer:
    """The PS: one stage pushes a wave's update, then pulls the weights that contain it."""

    def __init__(
        self,
        group: ChildGroup,
        model: dict[str, np.ndarray],
        shards: int,
        mode: str,
        keys: tuple[ServerKeys, ClientKeys] | None = None,
        durable: tuple[Path, int] | None = None,
        wire_dtype: str = "float32",
    ) -> None:
        endpoints = []
        name = (
            "ps-curve"
            if keys
            else "ps-durable"
            if durable
            else "ps-bf16"
            if wire_dtype != "float32"
            else "ps"
        )
        for s in range(shards):
            settings = ShardSettings(
                "bench",
                s,
                "tcp://127.0.0.1:0",
                0,
                mode,
                keys=keys[0] if keys else None,
                checkpoint_dir=Path(tempfile.mkdtemp(prefix=f"shard{s}-", dir=durable[0]))
                if durable
                else None,
                checkpoint_every=durable[1] if durable else 0,
                wire_dtype=wire_dtype,
            )
            endpoints.append(f"tcp://127.0.0.1:{start(group, f'{name}{s}', serve_settings, settings)}")
        placement = balanced_placement({k: v.nbytes for k, v in model.items()}, shards)
        self.model = model
        self.delta = {k: np.full_like(v, 1e-3) for k, v in model.items()}
        self.weights = {k: v.copy() for k, v in model.items()}
        self.ps = PSClient(
            endpoints,
            "bench",
            0,
            0,
            1,
            1,
            placement,
            timeout_s=120,
            retry_s=60,
            curve=keys[1] if keys else None,
            wire_dtype=wire_dtype,
        )
        self.rtol = 1e-5 if wire_dtype == "float32" else 4e-3  # a bfloat16 pull is rounded (relative 2^-9)
        self.ps.register(model, want_weights=False)
        self.wave = 0

    def round(self) -> float:
        t0 = time.perf_counter()
        self.ps.push(self.wave, self.delta)
        self.ps.pull(self.wave + 2, out=self.weights)  # D = 0: W_{wave+1} contains this push
        self.wave += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        key = next(iter(self.model))
        expected = self.model[key][:4] + np.float32(1e-3) * self.wave
        got = self.weights[key][:4]
        self.ps.close()
        if not np.allclose(got, expected, rtol=self.rtol, atol=1e-5):
            raise SystemExit(f"PS returned wrong weights: {got} != {expected}")


def bench_keys(directory: Path) -> tuple[ServerKeys, ClientKeys]:
    """A throwaway key set for the curve peer: the shards' keys and vw 0's pair."""
    write_keys(directory, key_users(1))
    return server_keys(directory), client_keys(directory, "vw0")


def measure(
    model: dict[str, np.ndarray],
    shards: int,
    rounds: int,
    mode: str,
    logs: Path,
    keys: tuple[ServerKeys, ClientKeys] | None,
    durable: int = 0,
    wire: str = "float32",
) -> dict[str, list[float]]:
    """Rounds of every peer, interleaved (the first of a round rotating), after one warm-up round each."""
    times: dict[str, list[float]] = {}
    with ChildGroup(logs) as group:
        peers = {"raw": RawPeer(group, model, shards), "ps": PsPeer(group, model, shards, mode)}
        if keys is not None:
            peers["ps_curve"] = PsPeer(group, model, shards, mode, keys)
        if durable:
            peers["ps_durable"] = PsPeer(group, model, shards, mode, durable=(logs, durable))
        if wire != "float32":
            peers["ps_bf16"] = PsPeer(group, model, shards, mode, wire_dtype=wire)
        names = list(peers)
        try:
            for r in range(rounds + 1):
                order = names[r % len(names) :] + names[: r % len(names)]
                took = {name: peers[name].round() for name in order}
                if r:
                    for name in names:
                        times.setdefault(name, []).append(took[name])
        finally:
            for peer in peers.values():
                peer.close()
    return times


@click.command()
@click.option("--sizes", default="10,100,400", show_default=True, help="Model sizes in MB.")
@click.option("--shards", "shard_counts", default="1,4", show_default=True, help="Shard counts.")
@click.option(
    "--rounds", default=9, show_default=True, help="Timed round trips per cell (after one warm-up)."
)
@click.option("--mode", type=click.Choice(["exact", "latest"]), default="exact", show_default=True)
@click.option(
    "--auth",
    type=click.Choice(["none", "curve"]),
    default="none",
    show_default=True,
    help='curve: also measure the PS with auth = "curve" (CurveZMQ), interleaved with the others.',
)
@click.option(
    "--durable",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="N > 0: also measure the PS checkpointing every N clocks (crash recovery), interleaved.",
)
@click.option(
    "--wire",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help='bfloat16: also measure the PS with [ps] wire_dtype = "bfloat16", interleaved.',
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write JSON rows here."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG plot (needs matplotlib, the `bench` extra); default: --out with .png.",
)
def main(
    sizes: str,
    shard_counts: str,
    rounds: int,
    mode: str,
    auth: str,
    durable: int,
    wire: str,
    out: Path | None,
    plot_path: Path | None,
) -> None:
    rows = []
    curve = auth == "curve"
    header = f"{'size_mb':>7} {'shards':>6} {'ps_gbps':>8} {'raw_gbps':>8} {'ratio':>6}"
    if curve:
        header += f" {'curve_gbps':>10} {'curve/ps':>8}"
    if durable:
        header += f" {'durable_gbps':>12} {'durable/ps':>10}"
    packed = wire != "float32"
    if packed:
        header += f" {'bf16_gbps':>9} {'bf16/ps':>7}"
    print(header + f"   (median of {rounds}; GB/s both ways)", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="hetpipe-bench-"))  # the shards' status lines go here
    keys = bench_keys(logs / "keys") if curve else None
    for size in (int(s) for s in sizes.split(",")):
        model = make_model(size)
        nbytes = 2 * sum(v.nbytes for v in model.values())
        for shards in (int(s) for s in shard_counts.split(",")):
            times = measure(model, shards, rounds, mode, logs, keys, durable, wire)
            row = {"size_mb": size, "shards": shards, "mode": mode}
            for name, took in times.items():
                row[f"{name}_gbps"] = round(nbytes / statistics.median(took) / 1e9, 3)
                row[f"{name}_spread_gbps"] = [
                    round(nbytes / max(took) / 1e9, 3),
                    round(nbytes / min(took) / 1e9, 3),
                ]
            row["ratio"] = round(row["ps_gbps"] / row["raw_gbps"], 3)
            line = (
                f"{size:>7} {shards:>6} {row['ps_gbps']:>8.2f} {row['raw_gbps']:>8.2f} {row['ratio']:>6.2f}"
            )
            if curve:
                row["curve_ratio"] = round(row["ps_curve_gbps"] / row["ps_gbps"], 3)
                line += f" {row['ps_curve_gbps']:>10.2f} {row['curve_ratio']:>8.2f}"
            if durable:
                row["durable_ratio"] = round(row["ps_durable_gbps"] / row["ps_gbps"], 3)
                line += f" {row['ps_durable_gbps']:>12.2f} {row['durable_ratio']:>10.2f}"
            if packed:
                row["bf16_ratio"] = round(row["ps_bf16_gbps"] / row["ps_gbps"], 3)
                line += f" {row['ps_bf16_gbps']:>9.2f} {row['bf16_ratio']:>7.2f}"
            rows.append(row)
            print(line, flush=True)
    if out is not None:
        meta = {"python": sys.version.split()[0], "zmq": zmq.zmq_version(), "machine": platform.machine()}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {out}")
    png = plot_path or (out.with_suffix(".png") if out else None)
    if png is not None:
        labels = [f"{r['size_mb']} MB, {r['shards']} shard{'s' * (r['shards'] > 1)}" for r in rows]
        series = {
            "hetpipe PS push+pull": [r["ps_gbps"] for r in rows],
            "raw ZeroMQ": [r["raw_gbps"] for r in rows],
        }
        if curve:
            series["hetpipe PS, auth = curve"] = [r["ps_curve_gbps"] for r in rows]
        if durable:
            series[f"hetpipe PS, checkpoint every {durable}"] = [r["ps_durable_gbps"] for r in rows]
        if packed:
            series["hetpipe PS, bfloat16 on the wire"] = [r["ps_bf16_gbps"] for r in rows]
        print(
            plots.paired_bars(labels, series, "GB/s (both ways)", f"PS round trips, median of {rounds}", png)
        )


if __name__ == "__main__":
    main()
