"""The facts about a device that decide which variants can run on it and which results apply.

The Triton interpreter is a device of its own, `cpu-interpreter`, so CPU tuning runs never
mix with GPU results in the database.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

CPU_INTERPRETER = "cpu-interpreter"


@dataclass(frozen=True)
class DeviceInfo:
    """What the search space and the tuning database need to know about a device."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    shared_memory: int  # bytes of shared memory one program may use
    registers: int = 65536  # 32-bit registers per SM

    @property
    def is_interpreter(self) -> bool:
        return self.name == CPU_INTERPRETER

    @property
    def is_hopper(self) -> bool:
        """Compute capability 9.x. The Gluon (fa3) kernels, their TMA descriptors and
        Triton's warp specialization here are written for Hopper's wgmma and were measured
        on it only; later GPUs (Blackwell is 10.x and 12.x) have other instructions, so
        they, like Ampere and Ada, get the portable Triton variants."""
        return self.capability[0] == 9 and not self.is_interpreter

    @property
    def key(self) -> str:
        """The GPU part of a tuning-database key: name, compute capability and SM count."""
        major, minor = self.capability
        return f"{self.name}|sm{major}{minor}|{self.sm_count}sm"

    def to_dict(self) -> dict:
        return asdict(self)


#: The interpreter has no shared-memory limit; a Hopper-sized one keeps its search space
#: the same shape as a real GPU's.
INTERPRETER = DeviceInfo(CPU_INTERPRETER, (0, 0), 1, 232448)


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 49152
    return DeviceInfo(
        props.name,
        (props.major, props.minor),
        props.multi_processor_count,
        int(smem),
        int(getattr(props, "regs_per_multiprocessor", 65536) or 65536),
    )


def device_info(device: torch.device | str | int | DeviceInfo | None = None) -> DeviceInfo:
    """Describe `device`: a CUDA device (index, string or torch.device) or the CPU interpreter."""
    if isinstance(device, DeviceInfo):
        return device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return INTERPRETER
    if device.type != "cuda":
        raise ValueError(
            f"unsupported device {device}; flashgen runs on CUDA GPUs or the CPU "
            "through the Triton interpreter"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_info(index)


def cuda_index(info: DeviceInfo) -> int:
    """The index of the first visible CUDA device that `info` describes (0 where none does):
    a key names a GPU model, a command line needs an index."""
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if _cuda_info(index).key == info.key:
                return index
    return 0
