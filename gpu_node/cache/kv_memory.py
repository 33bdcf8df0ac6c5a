"""How many KV blocks each tier holds: sized in bytes of the machine's memory, counted in the model's blocks.

A block's weight depends on the model (``KVBlockSpec.block_bytes``: layers x 2 x KV
heads x head dim x dtype bytes x block size) — 32 KiB for the tiny test model, 720 KiB
for SmolLM2-135M in float32, 2 MiB for Llama-3-8B in bfloat16 — so a tier sized in
blocks is a different amount of memory for every model. Tiers are therefore sized in
bytes and their block counts derived here, once the weights are loaded:

* device tier: ``device_memory_fraction`` of the device memory left after the weights
  (CUDA: the free memory ``torch.cuda.mem_get_info`` reports; CPU: ``MemAvailable`` of
  ``/proc/meminfo`` less the host tier, which lives in the same RAM);
* host tier: ``host_memory_bytes``; disk tier: ``disk_bytes``.

An explicit block count (``num_device_blocks`` …) still wins, for tests and benchmarks
that need an exact size. A plan whose memory tiers cannot fit what the machine has is
refused at start with one line naming the numbers (:class:`KVMemoryError`), rather than
failing on the first large allocation or being killed once the tiers fill.

CPU tensors of the tiers are zero pages of an anonymous mapping
(:func:`gpu_node.pool.memory_tier.lazy_zeros`): the kernel backs a page only when it
is first written, so a fresh node does not cost its tiers' full size in resident memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.settings import CacheSettings

DEFAULT_DEVICE_MEMORY_FRACTION = {"cuda": 0.8, "cpu": 0.4}
"""Of the memory left after the weights. Lower on CPU: that RAM is also the host tier's, the OS's and other processes'."""

GiB = 1024**3


class KVMemoryError(ValueError):
    """A cache configuration the machine cannot hold; the message is one line with the numbers."""


@dataclass(frozen=True, slots=True)
class AvailableMemory:
    """What the KV tiers may use, measured after the weights are loaded."""

    device_bytes: int
    """Free memory of the model's device (for a CPU device: the RAM below)."""
    ram_bytes: int
    """``MemAvailable``: RAM the host tier (and a CPU device tier) can take without swapping."""
    device_is_ram: bool


@dataclass(frozen=True, slots=True)
class TierPlan:
    """Block counts of the three tiers, and what they weigh."""

    num_device_blocks: int
    num_host_blocks: int
    max_disk_blocks: int
    block_size: int
    block_bytes: int

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Each tier's capacity: blocks, tokens and bytes."""
        counts = {
            "device": self.num_device_blocks,
            "host": self.num_host_blocks,
            "disk": self.max_disk_blocks,
        }
        return {
            tier: {
                "num_blocks": num,
                "num_tokens": num * self.block_size,
                "num_bytes": num * self.block_bytes,
            }
            for tier, num in counts.items()
        }

    def max_concurrency(self, context_tokens: int) -> float:
        """How many requests of ``context_tokens`` tokens the device tier holds at once (vLLM's
        "maximum concurrency")."""
        return self.num_device_blocks / math.ceil(context_tokens / self.block_size)

    def describe(self, context_tokens: int) -> str:
        """The start-up log line."""
        tiers = ", ".join(
            f"{tier} {stats['num_blocks']} blocks = {stats['num_tokens']} tokens = {_gib(stats['num_bytes'])}"
            for tier, stats in self.tier_stats().items()
        )
        return (
            f"KV tiers ({self.block_bytes} bytes per block of {self.block_size} tokens): {tiers}; "
            f"maximum concurrency for {context_tokens}-token requests: {self.max_concurrency(context_tokens):.2f}x"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """``MemAvailable`` of ``/proc/meminfo``: the kernel's estimate of RAM a new workload can take
    without swapping."""
    for line in meminfo.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, unit = value.split()
            assert unit == "kB", f"unexpected MemAvailable unit {unit!r}"
            return int(number) * 1024
    raise AssertionError(f"{meminfo} has no MemAvailable line")


def measure_available(device: str) -> AvailableMemory:
    """Free memory now, on ``device`` and in RAM: call it after the weights are loaded."""
    ram_bytes = mem_available_bytes()
    if torch.device(device).type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
        return AvailableMemory(free_bytes, ram_bytes, device_is_ram=False)
    return AvailableMemory(ram_bytes, ram_bytes, device_is_ram=True)


def plan_tiers(
    cache: CacheSettings, spec: KVBlockSpec, available: AvailableMemory, device_type: str
) -> TierPlan:
    """Block counts for ``cache`` on a machine with ``available`` memory; KVMemoryError when they
    cannot fit."""
    block_bytes = spec.block_bytes
    num_host_blocks = (
        cache.num_host_blocks
        if cache.num_host_blocks is not None
        else cache.host_memory_bytes // block_bytes
    )
    # On a CPU device both memory tiers are RAM: the device tier gets a share of what the host tier
    # leaves.
    device_free = available.device_bytes - (
        num_host_blocks * block_bytes if available.device_is_ram else 0
    )
    if cache.num_device_blocks is not None:
        num_device_blocks = cache.num_device_blocks
    else:
        fraction = cache.device_memory_fraction or DEFAULT_DEVICE_MEMORY_FRACTION.get(
            device_type, DEFAULT_DEVICE_MEMORY_FRACTION["cpu"]
        )
        num_device_blocks = max(0, int(fraction * device_free)) // block_bytes
    max_disk_blocks = (
        cache.max_disk_blocks
        if cache.max_disk_blocks is not None
        else cache.disk_bytes // block_bytes
    )
    plan = TierPlan(
        num_device_blocks, num_host_blocks, max_disk_blocks, spec.block_size, block_bytes
    )
    if num_device_blocks < 1:
        where = (
            "RAM left by the host tier"
            if available.device_is_ram
            else "device memory free after the weights"
        )
        raise KVMemoryError(
            f"the KV device tier cannot hold one {block_bytes}-byte block: {_gib(max(0, device_free))} of {where}"
        )
    _check_fits(plan, available)
    return plan


def _check_fits(plan: TierPlan, available: AvailableMemory) -> None:
    device_bytes = plan.num_device_blocks * plan.block_bytes
    if available.device_is_ram:
        tiers, blocks = "device + host tiers", f"{plan.num_device_blocks} + {plan.num_host_blocks}"
        ram_bytes = device_bytes + plan.num_host_blocks * plan.block_bytes
    else:
        tiers, blocks = "host tier", f"{plan.num_host_blocks}"
        ram_bytes = plan.num_host_blocks * plan.block_bytes
    if ram_bytes > available.ram_bytes:
        raise KVMemoryError(
            f"KV {tiers}: {blocks} blocks of {plan.block_bytes} bytes = {_gib(ram_bytes)} of RAM, "
            f"but {_gib(available.ram_bytes)} is available (MemAvailable)"
        )
    if not available.device_is_ram and device_bytes > available.device_bytes:
        raise KVMemoryError(
            f"KV device tier: {plan.num_device_blocks} blocks of {plan.block_bytes} bytes = {_gib(device_bytes)}, "
            f"but {_gib(available.device_bytes)} of device memory is free after the weights"
        )
