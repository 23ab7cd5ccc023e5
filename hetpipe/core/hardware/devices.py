"""Where each GPU of a cluster config computes, by one rule (docs/architecture.md#devices), and which
transport a virtual worker's stages use between them. Pure: the caller says how many CUDA devices it has.

The rule: GPU i of a node computes on `cuda:i`, unless the node lists `devices` (one per GPU, "cuda:<n>" or
"cpu"), which also lets several GPUs of the config share one physical device. Emulated GPUs compute on the
CPU unless `[emulation] device = "cuda"`, which puts them on the node's CUDA devices by the same rule (their
speed is then emulated by slowing the faster ones down). Without CUDA, real GPUs fall back to the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe.core.config.schema import ClusterConfig, GpuRef
from hetpipe.core.errors import UsageError

__all__ = ["p2p_backend", "stage_device"]


def stage_device(config: ClusterConfig, gpu: str | GpuRef, cuda_count: int) -> str:
    """The torch device ("cpu", "cuda:1") GPU `gpu` of the config computes on."""
    ref = GpuRef.parse(gpu) if isinstance(gpu, str) else gpu
    node = config.node(ref.node)
    emulation = config.emulation
    if emulation.enabled and emulation.device == "cpu":
        return "cpu"
    device = node.devices[ref.index] if node.devices else f"cuda:{ref.index}"
    if device == "cpu":
        return device
    if cuda_count == 0:
        if emulation.enabled:
            raise UsageError(
                f'{config.path}: emulation.device = "cuda" but this machine has no CUDA device: set '
                'device = "cpu" under [emulation], or run on the machine with the GPUs'
            )
        if node.devices:
            raise UsageError(
                f"{config.path}: node {node.name} lists devices {list(node.devices)} but this machine has "
                'no CUDA device: write "cpu" there, or run on the machine with the GPUs'
            )
        return "cpu"
    index = int(device.split(":")[1])
    if index >= cuda_count:
        where = f'its devices[{ref.index}] = "{device}"' if node.devices else f"GPU {ref.index} is {device}"
        raise UsageError(
            f"{config.path}: node {node.name}'s {where}, but this machine has {cuda_count} CUDA device"
            f"{'s' if cuda_count != 1 else ''}: list devices = [...] under that [[nodes]] table "
            f"(several GPUs may share one, e.g. devices = {['cuda:0'] * len(node.gpus)})".replace("'", '"')
        )
    return device


def p2p_backend(devices: Sequence[str]) -> str:
    """The stages of a VW talk over NCCL when each has a CUDA device of its own, else over gloo (a CUDA
    tensor then goes through a host buffer: NCCL refuses two ranks on one GPU)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    return (
        "nccl" if len(cuda) == len(devices) and len(set(cuda)) == len(cuda) and len(devices) > 1 else "gloo"
    )
