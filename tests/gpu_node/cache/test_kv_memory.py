"""KV tiers sized in bytes: block counts derived from the model's KV block, refusal of what cannot fit, lazy tiers."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_node.cache.kv_memory import AvailableMemory, KVMemoryError, mem_available_bytes, plan_tiers
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.memory_tier import lazy_zeros
from gpu_node.pool.vocabulary import PoolConfig
from gpu_node.settings import CacheSettings, NodeSettings
from prefix_keys.blocks import CacheScope

GiB = 1024**3
TINY = KVBlockSpec(
    num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32
)  # kvledger model init --tiny
SMOLLM2 = KVBlockSpec(
    num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32
)
LLAMA3_8B = KVBlockSpec(
    num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16
)
GPU_80G = AvailableMemory(device_bytes=64 * GiB, ram_bytes=200 * GiB, device_is_ram=False)
CPU_8G = AvailableMemory(device_bytes=8 * GiB, ram_bytes=8 * GiB, device_is_ram=True)


def test_block_bytes_of_known_models():
    assert TINY.block_bytes == 32 * 1024
    assert SMOLLM2.block_bytes == 737_280
    assert LLAMA3_8B.block_bytes == 2 * 1024**2


def test_cuda_tiers_are_derived_from_bytes():
    plan = plan_tiers(CacheSettings(), LLAMA3_8B, GPU_80G, "cuda")
    # 0.8 of the 64 GiB left after the weights, 2 GiB host, 16 GiB disk, in 2 MiB blocks
    assert (plan.num_device_blocks, plan.num_host_blocks, plan.max_disk_blocks) == (
        26214,
        1024,
        8192,
    )
    assert plan.tier_stats()["device"] == {
        "num_blocks": 26214,
        "num_tokens": 26214 * 16,
        "num_bytes": 26214 * 2 * 1024**2,
    }
    assert plan.max_concurrency(8192) == 26214 / 512


def test_cpu_device_tier_shares_ram_with_the_host_tier():
    plan = plan_tiers(CacheSettings(host_memory_bytes=GiB, disk_bytes=GiB), SMOLLM2, CPU_8G, "cpu")
    # 0.4 of (8 GiB - 1 GiB host) in 737,280-byte blocks; 1 GiB host and disk
    assert (plan.num_device_blocks, plan.num_host_blocks, plan.max_disk_blocks) == (
        4077,
        1456,
        1456,
    )
    fraction = plan_tiers(
        CacheSettings(device_memory_fraction=0.5, host_memory_bytes=0), TINY, CPU_8G, "cpu"
    )
    assert fraction.num_device_blocks == 4 * GiB // (32 * 1024) == 131072


def test_explicit_block_counts_win():
    cache = CacheSettings(num_device_blocks=256, num_host_blocks=128, max_disk_blocks=512)
    plan = plan_tiers(cache, LLAMA3_8B, GPU_80G, "cuda")
    assert (plan.num_device_blocks, plan.num_host_blocks, plan.max_disk_blocks) == (256, 128, 512)
    with pytest.raises(ValueError, match="not both"):
        CacheSettings(num_device_blocks=256, device_memory_fraction=0.5)


@pytest.mark.parametrize(
    ("cache", "available", "message"),
    [
        (
            CacheSettings(host_memory_bytes=300 * GiB),
            GPU_80G,
            "KV host tier: 153600 blocks of 2097152 bytes = 300.00 GiB of RAM, but 200.00 GiB is available (MemAvailable)",
        ),
        (
            CacheSettings(num_device_blocks=40960),
            GPU_80G,
            "KV device tier: 40960 blocks of 2097152 bytes = 80.00 GiB, but 64.00 GiB of device memory is free after the weights",
        ),
        (
            CacheSettings(num_device_blocks=3000, host_memory_bytes=4 * GiB),
            CPU_8G,
            "KV device + host tiers: 3000 + 2048 blocks of 2097152 bytes = 9.86 GiB of RAM, but 8.00 GiB is available (MemAvailable)",
        ),
        (
            CacheSettings(host_memory_bytes=8 * GiB),
            CPU_8G,
            "the KV device tier cannot hold one 2097152-byte block: 0.00 GiB of RAM left by the host tier",
        ),
    ],
)
def test_what_cannot_fit_is_refused_in_one_line(cache, available, message):
    with pytest.raises(KVMemoryError) as error:
        plan_tiers(cache, LLAMA3_8B, available, "cpu" if available.device_is_ram else "cuda")
    assert str(error.value) == message


def test_mem_available_is_read_from_proc_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   24185304 kB\n"
    )
    assert mem_available_bytes(meminfo) == 24185304 * 1024


def test_node_that_cannot_fit_refuses_to_start_with_one_line(tiny_model_dir, tmp_path, fork_server):
    tiers = {
        "KVLEDGER_NODE_CACHE__NUM_DEVICE_BLOCKS": "64",
        "KVLEDGER_NODE_CACHE__HOST_MEMORY_BYTES": str(2**50),
    }
    env = os.environ | tiers | {"KVLEDGER_JWT_SECRET": "x" * 40}
    args = ["--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "node"), "--port", "0"]
    result = fork_server.run(["node", *args], env, tmp_path / "cli", timeout_s=300)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    prefix = "kvledger node: error: KV device + host tiers: 64 + 34359738368 blocks of 32768 bytes = 1048576.00 GiB of RAM, but "
    assert errors[0].startswith(prefix) and errors[0].endswith(" GiB is available (MemAvailable)")


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_lazy_zeros_are_zero_and_backed_only_where_written():
    before = rss_bytes()
    table = lazy_zeros((16384, 16384), torch.float32)  # 1 GiB
    assert rss_bytes() - before < 64 * 1024**2
    assert (
        table[12345].abs().sum().item() == 0.0
    )  # reads of unwritten pages see zeros (and back no page)
    table[:1024] = 1.0  # 64 MiB written
    grown = rss_bytes() - before
    assert 60 * 1024**2 < grown < 128 * 1024**2
    assert table[:1024].sum().item() == 1024 * 16384


def test_fresh_pool_does_not_cost_its_tiers_in_rss(tmp_path):
    before = rss_bytes()
    config = PoolConfig(
        namespace="rss-test",
        num_device_blocks=16384,  # 512 MiB of 32 KiB blocks
        num_host_blocks=32768,  # 1 GiB
        max_disk_blocks=0,
        disk_dir=None,
        ttl_s=dict.fromkeys(CacheScope, None),
    )
    pool = BlockPool(TINY, config, LocalKeyStore(tmp_path / "keys.json"))
    assert rss_bytes() - before < 64 * 1024**2
    assert pool.device_kv.shape[0] == 16384


async def test_engine_logs_and_reports_its_tiers(tiny_model_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="gpu_node.engine.async_engine")
    before = rss_bytes()
    cache = CacheSettings(host_memory_bytes=GiB, disk_bytes=2 * GiB)
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node", cache=cache)
    )
    capacity = engine.cache_stats()["capacity"]
    assert capacity["host"] == {"num_blocks": 32768, "num_tokens": 32768 * 16, "num_bytes": GiB}
    assert capacity["disk"]["num_blocks"] == 65536
    num_device = capacity["device"]["num_blocks"]
    assert (
        num_device == engine.pool.config.num_device_blocks >= 1
    )  # 0.4 of the RAM the host tier leaves: depends on the machine
    assert engine.cache_stats()["max_concurrency"] == {
        "context_tokens": 4096,
        "num_requests": round(num_device / 256, 2),
    }
    # Gigabytes of tiers, megabytes of resident memory: the tiny model and the pool's bookkeeping.
    assert rss_bytes() - before < 512 * 1024**2
    line = next(
        record.getMessage()
        for record in caplog.records
        if record.getMessage().startswith("KV tiers")
    )
    assert f"host 32768 blocks = {32768 * 16} tokens = 1.00 GiB" in line
    assert f"maximum concurrency for 4096-token requests: {num_device / 256:.2f}x" in line
