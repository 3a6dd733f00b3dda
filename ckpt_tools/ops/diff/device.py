"""`diff-vs-base --adapter --device cuda`: the value check's expected values on a GPU.

What moves: for each unit of a targeted tensor (consecutive row blocks, UNIT_BYTES a side), W and W0 go to the
device as read, P = L @ R rows are computed there in fp64 (cuBLAS: any kernel), and
`core.tensor_math.check_merged_values_bounded` runs there: the margin at both ends of each rounding and the
fixed-order product where a rounding is within it make its counts those of the definition, whatever kernel
computed P, so they equal the CPU path's exactly (same ties, same elements off, same max_ulps). What stays:
the
reads and the statistics of W - W0 (the C kernels, in the same chunks as on the CPU, so the figures are the
same
bits too).

Memory, bounded by construction: SLOTS units in flight, each a pair of pinned host buffers of UNIT_BYTES that
the
reads land in (allocated once per run, so RSS does not grow with the workers or the largest tensor) and, on
the
device, one unit's W, W0 and about a dozen fp64 temporaries of its size (~100x UNIT_BYTES / itemsize bytes at
most).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...core.errors import UsageError
from ...core.tensor_math import LoraFactors64, MergeCheck, check_merged_values_bounded

__all__ = ["SLOTS", "UNIT_BYTES", "DeviceCheck", "resolve_device", "units_of"]

UNIT_BYTES = (
    8 * 2**20
)  # a side's bytes per unit (a bf16 unit: 4M elements; launches amortized, memory bounded)
SLOTS = 4  # units in flight (their threads read, compute the statistics, upload, check)


def resolve_device(device: str | None) -> torch.device | None:
    """None for the CPU (the default), else the CUDA device asked for; a usage error where there is none."""
    if device is None or device == "cpu":
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise UsageError(
            f"--device {device!r}: not a device the check runs on",
            hint="use --device cpu (the default: every core) or --device cuda (or cuda:N)",
        )
    if not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise UsageError(
            f"--device {device}: no CUDA device here (torch.cuda.is_available() is False; torch "
            f"{torch.__version__} is {build})",
            hint="run where an NVIDIA GPU and a CUDA build of torch are installed, or leave out --device "
            "(the check then runs on every CPU core, with the same verdicts and counts)",
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise UsageError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            hint=f"use --device cuda:0 .. cuda:{torch.cuda.device_count() - 1}",
        )
    return torch.device("cuda", index)


def units_of(blocks: list[tuple[int, int]], itemsize: int, unit_bytes: int) -> list[list[tuple[int, int]]]:
    """Consecutive blocks grouped into units of at most `unit_bytes` a side (a larger block alone)."""
    units: list[list[tuple[int, int]]] = []
    size = 0
    for block in blocks:
        nbytes = block[1] * itemsize
        if units and size + nbytes <= unit_bytes:
            units[-1].append(block)
            size += nbytes
        else:
            units.append([block])
            size = nbytes
    return units


class DeviceCheck:
    """The run's device, its SLOTS pairs of pinned host buffers (the reads land in them: `slot()`), and the
    check of one unit there (`check`). Threads share it; each unit holds one slot from its read to its
    counts."""

    def __init__(self, device: torch.device, unit_bytes: int | None = None):
        self.device = device
        self.unit_bytes = unit_bytes or UNIT_BYTES
        self._pin = device.type == "cuda"  # (a CPU "device": the same path without a GPU, for the tests)
        self._free: queue.Queue[tuple[torch.Tensor, torch.Tensor]] = queue.Queue()
        self._lock = threading.Lock()
        self._made = 0

    @property
    def host_bytes(self) -> int:
        """Pinned host memory at most (what the run's working budget sets aside)."""
        return SLOTS * 2 * self.unit_bytes

    @contextmanager
    def slot(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A pair of pinned uint8 buffers of `unit_bytes` (W's, W0's), waiting while SLOTS units are in
        flight."""
        pair: tuple[torch.Tensor, torch.Tensor] | None = None
        with self._lock:
            if self._free.empty() and self._made < SLOTS:
                self._made += 1
                pair = (
                    torch.empty(self.unit_bytes, dtype=torch.uint8, pin_memory=self._pin),
                    torch.empty(self.unit_bytes, dtype=torch.uint8, pin_memory=self._pin),
                )
        if pair is None:
            pair = self._free.get()
        try:
            yield pair
        finally:
            self._free.put(pair)

    def factors(self, f: LoraFactors64) -> LoraFactors64:
        """The factors and their norms on the device, bit for bit (the norms are not recomputed there)."""
        return f.to(self.device)

    def upload(self, w: torch.Tensor, w0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start copying a unit's W and W0 (host tensors over a slot's pinned bytes) to the device: the copies
        run while this thread computes the unit's statistics (the slot's bytes are only read meanwhile)."""
        return w.to(self.device, non_blocking=True), w0.to(self.device, non_blocking=True)

    def check(
        self, w: torch.Tensor, w0: torch.Tensor, f: LoraFactors64, r0: int, r1: int, scale: float
    ) -> MergeCheck:
        """Rows [r0, r1) of a targeted tensor (`w`, `w0`: `upload`'s device tensors; `f`: the device's
        factors):
        the counts of `check_merged_values` (returned when the device is done, so the slot may be reused)."""
        prod = (f.left[r0:r1] @ f.right).reshape(-1)
        return check_merged_values_bounded(w, w0, prod, f, r0, 0, scale)
