"""Where a training run computes: its device, its precision, and its place among torchrun's processes.

Only train/common.py imports this module; trainers and data generators reach it through common.py. A run
started by `torchrun --nproc-per-node N` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) joins the
process group here: nccl on GPUs, gloo on CPUs, rank r on cuda:LOCAL_RANK. Precision is autocast's compute
type: the trained weights and the optimizer state stay fp32 (master weights); bf16 where the device computes
it natively, fp32 elsewhere.
"""
from __future__ import annotations

import atexit
import functools
import os
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..exit import as_worker

DEVICES = ("auto", "cpu", "cuda")              # the names --device takes (and cuda:N)
AUTO, CPU, CUDA = DEVICES
PRECISIONS = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}
# the main rank writes, evaluates and fills feature stores while the others wait in a collective
WAIT = timedelta(hours=2)


class DeviceError(ValueError):
    """A --device or --dtype this machine cannot run; one line for the user."""


def native_bf16(device: torch.device) -> bool:
    """Whether the device computes bf16 natively (so that autocast to it is faster, not an emulation): a CUDA
    GPU with bf16, a CPU with AVX512-BF16 or AMX (treegen.loading's test, the one serving uses)."""
    from ..loading import native_bf16 as cpu_bf16

    if device.type == CUDA:
        return torch.cuda.is_bf16_supported()
    return device.type == CPU and cpu_bf16()


def check_device(device: str) -> None:
    """A device this machine lacks, or a name no device has: DeviceError before anything loads."""
    if device not in DEVICES and not (device.startswith(CUDA + ":") and device[5:].isdigit()):
        raise DeviceError(f"--device {device}: use one of {', '.join(DEVICES)} or cuda:N")
    if device.startswith(CUDA) and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__})")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise DeviceError(f"--dtype {precision}: use one of {', '.join(PRECISIONS)}")


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def main_rank() -> bool:
    """Whether this process writes and logs: always alone, rank 0 under torchrun."""
    return env_int("RANK", 0) == 0


def pick_device(device: str, local_rank: int) -> torch.device:
    check_device(device)
    if device == AUTO:
        device = CUDA if torch.cuda.is_available() else CPU
    if device == CUDA:   # one GPU per process under torchrun
        return torch.device(CUDA, local_rank)
    return torch.device(device)


def pick_precision(precision: str, device: torch.device) -> torch.dtype:
    check_precision(precision)
    chosen = PRECISIONS[precision]
    if chosen is None:
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return chosen


@dataclass(frozen=True)
class Runtime:
    """One process of a run: its device, autocast's compute type, and its rank among `world`."""
    device: torch.device
    precision: torch.dtype
    rank: int = 0
    world: int = 1
    option_device: str = "auto"      # what --device and --dtype said (a config passes them on)
    option_precision: str = "auto"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def target_dtype(self) -> str:
        """The frozen target's weights as `treegen chat` serves them on this device (treegen.loading's auto:
        bf16 where the device has it natively), or fp32 throughout when the run computes in fp32."""
        from ..loading import resolve_dtype

        dtype = torch.float32 if self.precision == torch.float32 else resolve_dtype(AUTO, self.device)
        return str(dtype).removeprefix("torch.")

    def autocast(self):
        if self.precision == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision)

    def shard(self, batch):
        """This rank's equal slice (dim 0) of a global batch: a tensor, or a dict of them (None kept)."""
        if isinstance(batch, dict):
            return {k: self.shard(v) for k, v in batch.items()}
        if batch is None or self.world == 1:
            return batch
        size = len(batch) // self.world
        return batch[self.rank * size:(self.rank + 1) * size]

    def to_device(self, batch):
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch.to(self.device) if isinstance(batch, torch.Tensor) else batch

    def check_batch(self, batch: int) -> None:
        if batch % self.world:
            raise ValueError(f"--batch {batch} is the global batch: it must divide among {self.world} processes")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DistributedDataParallel over the ranks (gradients all-reduced in backward); the model itself alone."""
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == CUDA else None
        return DistributedDataParallel(model, device_ids=ids)

    def mean(self, value: float) -> float:
        """A number averaged over the ranks (every rank must call it at the same point)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def most(self, value: float) -> float:
        """The largest of the ranks' values, on every rank (wall time: all ranks agree when a budget ends)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def anyone(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a stop request one rank saw first)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def mine(self, n: int) -> range:
        """The item indices this rank handles out of n (round robin: rank r takes r, r + world, ...)."""
        return range(self.rank, n, self.world)

    def log(self, write):
        """`write` on the main rank; a no-op elsewhere (progress and messages print once)."""
        return write if self.main else (lambda *args, **kwargs: None)


def as_served(target):
    """The frozen target's forward in its own weights' precision, outside any autocast: the features a
    drafter learns from are the ones it is served with."""
    return torch.autocast(target.device.type, enabled=False)


@functools.cache
def runtime(device: str = "auto", precision: str = "auto") -> Runtime:
    """This process's Runtime; under torchrun the first call joins the process group."""
    rank, world, local = env_int("RANK", 0), env_int("WORLD_SIZE", 1), env_int("LOCAL_RANK", 0)
    dev = pick_device(device, local)
    dtype = pick_precision(precision, dev)
    if world > 1 and not dist.is_initialized():
        if dev.type == CUDA:
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == CUDA else "gloo", timeout=WAIT)
        atexit.register(torn_down)
        as_worker()   # the process ends without the interpreter's teardown (treegen/exit.py)
    return Runtime(dev, dtype, rank, world, device, precision)


def leave() -> None:
    """A run's end, on every rank at once: wait for the main rank's last writes, then leave the process group
    before the interpreter exits (a rank that tears its group down while a peer still works can abort)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def torn_down() -> None:
    """At exit, a group that leave() did not end (a failed run: no barrier, a peer may be gone)."""
    if dist.is_initialized():
        dist.destroy_process_group()
