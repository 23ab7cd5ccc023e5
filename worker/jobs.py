"""What each stage process of a virtual worker is given: its StageJob (the packed config, its place in the
VW, where the PS and its neighbours are, its emulated slowdown and device)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from hetpipe.compute.build import VwLayout, handover_sources, run_work, vw_config
from hetpipe.core.config.schema import ClusterConfig
from hetpipe.core.config.serialize import pack_config, unpack_config
from hetpipe.core.hardware.devices import stage_device
from hetpipe.core.hardware.emulate import cpu_cores, slowdowns
from hetpipe.core.pipeline.profile_window import ProfileWindow
from hetpipe.core.protocol.keys import ClientKeys
from hetpipe.core.wsp.work import VwWork, sample_weights

__all__ = ["StageJob", "cuda_devices", "emulated_slowdowns", "stage_jobs"]


@dataclass(frozen=True)
class StageJob:
    """Everything a stage process needs, passed to a spawned child; the config travels parsed (packed)."""

    packed_config: bytes  # hetpipe.core.config.pack_config of the effective config, as this VW runs it
    run_dir: str
    vw: int
    stage: int
    num_vws: int
    gpus: tuple[str, ...]  # this VW's GPUs in stage order
    split: tuple[int, ...]  # layers per stage of this VW
    ps_endpoints: tuple[str, ...]
    p2p_port: int  # rendezvous port of this VW's process group
    p2p_host: str = "127.0.0.1"  # where stage 0 of this VW hosts the process-group rendezvous
    slowdown: float = 1.0  # emulation: compute runs this many times slower
    time_scale: float = 1.0  # emulation: the global slowdown, also applied to emulated link delays
    device: str = "cpu"
    devices: tuple[
        str, ...
    ] = ()  # every stage's device in this VW (the transport between them depends on it)
    dump_weights: bool = False  # write the stage's final live weights (for equivalence tests)
    audit: bool = False  # carry a tagged-update ledger and check guarantees L and G at every forward
    ps_keys: ClientKeys | None = None  # auth = "curve": this VW's key pair (only this VW's) and the PS's key
    start_wave: int = 0  # > 0: the VW rejoins the run at this wave (from the global weights, fresh optimizer)
    resume_wave: int = 0  # > 0: continue from this stage's checkpoint at that wave (hetpipe train --resume)
    snapshot_every: int = 0  # > 0: save this stage's state every this many waves under <run_dir>/stages
    snapshot_keep: int = 3  # snapshots that may still match one of the PS's kept checkpoints
    first_vw: VwLayout | None = None  # the run's first VW: placement "local" puts each layer where it runs
    profile: ProfileWindow | None = None  # hetpipe train --profile: torch.profiler over these minibatches
    work: tuple[VwWork, ...] = ()  # every VW's work per wave (Nm, batch); (): every VW as this config says
    spans: tuple[tuple[int, int], ...] = ()  # every VW's planned waves [start, end); (): all of the run's
    handover_from: int | None = None  # the VW whose optimizer state this VW starts with (a re-plan's)
    handover_stages: int = 0  # that VW's stages (each writes its part)
    hands_over: bool = False  # a later VW starts with this VW's optimizer state: write it at the end

    @cached_property
    def config(self) -> ClusterConfig:
        return unpack_config(self.packed_config)

    @property
    def run_work(self) -> tuple[VwWork, ...]:
        """Every VW's Nm and minibatch size, in VW order."""
        config = self.config
        return self.work or (VwWork(config.wsp.nm, config.train.batch_size),) * self.num_vws

    @property
    def nms(self) -> tuple[int, ...]:
        """Every VW's Nm, in VW order."""
        return tuple(w.nm for w in self.run_work)

    @property
    def vw_weights(self) -> tuple[int, ...]:
        """Every VW's weight by samples (hetpipe.core.wsp.work)."""
        return sample_weights(self.run_work)

    @property
    def vw_spans(self) -> tuple[tuple[int, int], ...]:
        """Every VW's waves [start, end), in VW order (docs/wsp.md#planned-spans)."""
        return self.spans or ((0, self.config.train.waves),) * self.num_vws

    @property
    def end_wave(self) -> int:
        """The wave boundary this VW stops at (the run's end, or its planned span's)."""
        return self.vw_spans[self.vw][1]

    @property
    def num_stages(self) -> int:
        return len(self.split)

    @property
    def layers(self) -> tuple[int, int]:
        start = sum(self.split[: self.stage])
        return start, start + self.split[self.stage]


def emulated_slowdowns(config: ClusterConfig, vws: tuple[VwLayout, ...]) -> tuple[dict[str, float], float]:
    """Each GPU's slowdown under emulation (empty when off) and the time scale (the fastest GPU's
    slowdown)."""
    if not config.emulation.enabled:
        return {}, 1.0
    speeds = {g: config.gpu(g).speed for lay in vws for g in lay.gpus}
    slow = slowdowns(speeds, cpu_cores(), config.emulation.time_scale)
    return slow, min(slow.values())


def cuda_devices() -> int:
    """CUDA devices this machine has (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def stage_jobs(
    config: ClusterConfig,
    vws: tuple[VwLayout, ...],
    vw: int,
    *,
    run_dir: Path,
    ps_endpoints: tuple[str, ...],
    p2p_host: str,
    p2p_port: int,
    audit: bool = False,
    dump_weights: bool = False,
    ps_keys: ClientKeys | None = None,
    start_wave: int = 0,
    resume_wave: int = 0,
    snapshots: bool = False,
    profile: ProfileWindow | None = None,
) -> list[StageJob]:
    """The jobs of every stage of virtual worker `vw` (of `vws`, all the run's VWs); `ps_keys` must be vw's.
    `snapshots`: the stages save their state at the PS's checkpoint waves ([checkpoint] every, stages). A VW
    planned to train from a later wave (docs/wsp.md#planned-spans) starts there, as a rejoining one does."""
    lay = vws[vw]
    slow, time_scale = emulated_slowdowns(config, vws)
    packed = pack_config(vw_config(config, lay))
    cuda = cuda_devices()
    devices = tuple(stage_device(config, g, cuda) for g in lay.gpus)
    planned = any(other.waves for other in vws)  # a re-plan: VWs that train some waves only
    spans = tuple(other.span(config.train.waves) for other in vws) if planned else ()
    sources = handover_sources(config, vws)
    source = sources.get(vw)
    return [
        StageJob(
            packed_config=packed,
            run_dir=str(run_dir),
            vw=vw,
            stage=s,
            num_vws=len(vws),
            gpus=lay.gpus,
            split=lay.split,
            ps_endpoints=ps_endpoints,
            p2p_port=p2p_port,
            p2p_host=p2p_host,
            devices=devices,
            slowdown=slow.get(lay.gpus[s], 1.0),
            time_scale=time_scale,
            device=devices[s],
            dump_weights=dump_weights,
            audit=audit,
            ps_keys=ps_keys,
            start_wave=max(start_wave, lay.span(config.train.waves)[0]),
            resume_wave=resume_wave,
            snapshot_every=config.checkpoint.every if snapshots and config.checkpoint.stages else 0,
            snapshot_keep=config.checkpoint.keep,
            first_vw=vws[0],
            profile=profile,
            work=run_work(config, vws),
            spans=spans,
            handover_from=source,
            handover_stages=len(vws[source].split) if source is not None else 0,
            hands_over=vw in sources.values(),
        )
        for s in range(len(lay.split))
    ]
