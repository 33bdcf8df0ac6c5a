"""``kvledger cost``: the token cost model and the KV size formula, pinned to their worked examples."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from kvledger.cli import main
from kvledger.cost import (
    Prices,
    estimate_cost,
    kv_shape,
    load_config,
    load_prices,
    parse_duration,
    served_cost,
)

REPO = Path(__file__).resolve().parents[2]
WORKED_EXAMPLE = {
    "prompt_tokens": 10_000, "cached_tokens": 8_000, "output_tokens": 500, "num_requests": 100,
    "price_input": 1.0, "price_cached_input": 0.1, "price_output": 2.0,
}  # fmt: skip
WORKED_EXAMPLE_ARGS = [
    "--prompt-tokens", "10000", "--cached-tokens", "8000", "--output-tokens", "500", "--requests", "100",
    "--price-input", "1", "--price-cached-input", "0.1", "--price-output", "2",
]  # fmt: skip
LLAMA_7B_SHAPE = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}


def test_worked_example():
    estimate = estimate_cost(**WORKED_EXAMPLE)
    # 100 × (10,000 × 1 + 500 × 2) / 1e6
    assert estimate.cost_without_cache_usd == pytest.approx(1.1, abs=1e-12)
    # 10,000 × 1 / 1e6 + 99 × (2,000 × 1 + 8,000 × 0.1) / 1e6 + 100 × 500 × 2 / 1e6 = 0.01 + 0.2772
    # + 0.1
    assert estimate.cost_with_cache_usd == pytest.approx(0.3872, abs=1e-12)
    assert estimate.net_saving_usd == pytest.approx(0.7128, abs=1e-12)
    assert estimate.saving_ratio == pytest.approx(0.7128 / 1.1)
    assert estimate.reusable_token_ratio == 0.8


def test_cache_write_price_applies_to_the_prefix_the_first_request_writes():
    estimate = estimate_cost(**WORKED_EXAMPLE, price_cache_write=1.25)
    # the first request's 8,000 prefix tokens cost 1.25 instead of 1 per million: + 8,000 × 0.25 /
    # 1e6
    assert estimate.cost_with_cache_usd == pytest.approx(0.3872 + 0.002, abs=1e-12)
    assert estimate.cost_without_cache_usd == pytest.approx(1.1, abs=1e-12)


def test_storage_cost_is_subtracted_and_can_make_the_cache_a_loss():
    assert estimate_cost(**WORKED_EXAMPLE, storage_cost_usd=0.5).net_saving_usd == pytest.approx(
        0.2128, abs=1e-12
    )
    loss = estimate_cost(**WORKED_EXAMPLE, storage_cost_usd=1.0)
    assert loss.net_saving_usd == pytest.approx(-0.2872, abs=1e-12)
    assert loss.saving_ratio < 0


def test_one_request_saves_nothing():
    estimate = estimate_cost(**(WORKED_EXAMPLE | {"num_requests": 1}))
    assert estimate.cost_with_cache_usd == pytest.approx(estimate.cost_without_cache_usd, abs=1e-15)
    assert estimate.net_saving_usd == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cached_tokens": 10_001}, "cannot exceed prompt tokens"),
        ({"num_requests": 0}, "requests must be at least 1"),
        ({"prompt_tokens": 0, "cached_tokens": 0}, "prompt tokens must be at least 1"),
        ({"output_tokens": -1}, "output tokens must not be negative"),
        ({"price_cached_input": -0.1}, "cached input price must not be negative"),
        ({"price_cache_write": -1.0}, "cache write price must not be negative"),
    ],
)
def test_impossible_workloads_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        estimate_cost(**(WORKED_EXAMPLE | change))


def test_cli_prints_the_worked_example(capsys):
    assert main(["cost", "model", *WORKED_EXAMPLE_ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "cost without cache    1.1 USD"
    assert lines[1] == "cost with cache       0.3872 USD"
    assert lines[3] == "net saving            0.7128 USD (64.8% of the cost without cache)"
    assert lines[4] == "reusable token ratio  0.8"


def test_cli_json(capsys):
    assert main(["cost", "model", *WORKED_EXAMPLE_ARGS, "--storage-cost", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "cost_without_cache_usd": 1.1,
        "cost_with_cache_usd": 0.3872,
        "storage_cost_usd": 1.0,
        "net_saving_usd": -0.2872,
        "saving_ratio": round(-0.2872 / 1.1, 10),
        "reusable_token_ratio": 0.8,
    }


def test_cli_bad_input_is_one_line_and_exit_2():
    run = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "cost", "model", *WORKED_EXAMPLE_ARGS[:2], "--cached-tokens", "20000", *WORKED_EXAMPLE_ARGS[4:]],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2
    assert (
        run.stderr == "kvledger: error: cached tokens (20000) cannot exceed prompt tokens (10000)\n"
    )
    assert run.stdout == ""


def test_kv_worked_example():
    shape = kv_shape(LLAMA_7B_SHAPE)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (
        32,
        32,
        128,
        2,
    )
    assert shape.bytes_per_token == 32 * 2 * 32 * 128 * 2 == 524_288
    assert shape.bytes_per_token * 10_000 == 5_242_880_000  # 5.24 GB


def test_kv_fallbacks_and_overrides():
    # no KV heads: every attention head keeps its own K and V; no head_dim: hidden / heads; no dtype: half precision
    bare = kv_shape({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512})
    assert (bare.num_kv_heads, bare.head_dim, bare.dtype, bare.dtype_bytes) == (
        8,
        64,
        "bfloat16",
        2,
    )
    # GQA and an explicit head_dim that is not hidden / heads; dtype under its newer key
    gqa = kv_shape(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 512,
            "head_dim": 128,
            "dtype": "float32",
        }
    )
    assert gqa.bytes_per_token == 2 * 2 * 2 * 128 * 4
    assert kv_shape({**LLAMA_7B_SHAPE, "head_dim": None}).head_dim == 128
    assert kv_shape(LLAMA_7B_SHAPE, dtype="float8_e4m3fn").dtype_bytes == 1
    assert kv_shape({"text_config": LLAMA_7B_SHAPE, "vision_config": {}}).bytes_per_token == 524_288


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": 4096}, "no num_hidden_layers"),
        (
            {**LLAMA_7B_SHAPE, "num_key_value_heads": 0},
            "num_key_value_heads must be a positive integer",
        ),
        ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 512}, "does not divide"),
        ({**LLAMA_7B_SHAPE, "torch_dtype": "float12"}, "unknown dtype 'float12'"),
        (
            {**LLAMA_7B_SHAPE, "num_hidden_layers": True},
            "num_hidden_layers must be a positive integer",
        ),
    ],
)
def test_kv_refuses_configs_it_cannot_size(config, message):
    with pytest.raises(ValueError, match=message):
        kv_shape(config)


def test_kv_cli_with_a_config_file(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_7B_SHAPE))
    assert main(["cost", "kv", "--config", str(config), "--tokens", "10000"]) == 0
    out = capsys.readouterr().out
    assert "per token             524,288 bytes" in out
    assert "5,242,880,000 bytes = 5.24 GB = 4.88 GiB" in out

    assert (
        main(["cost", "kv", "--config", str(config), "--tokens", "10000", "--batch", "4", "--json"])
        == 0
    )
    sizes = json.loads(capsys.readouterr().out)
    assert sizes["bytes_per_token"] == 524_288
    assert sizes["total_bytes"] == 4 * 5_242_880_000


def test_kv_cli_with_the_tiny_model(tiny_model_dir, capsys):
    config = load_config(str(tiny_model_dir), None)
    assert main(["cost", "kv", "--model", str(tiny_model_dir), "--tokens", "1000", "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)
    per_token = (
        config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    )
    assert (sizes["dtype"], sizes["bytes_per_token"], sizes["total_bytes"]) == (
        "float32",
        per_token,
        per_token * 1000,
    )
    assert per_token == 4 * 2 * 2 * 32 * 4


def test_kv_does_not_import_torch(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_7B_SHAPE))
    script = (
        "import sys; from kvledger.cli import main; "
        f"code = main(['cost', 'kv', '--config', {str(config)!r}, '--tokens', '1']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr


def test_kv_cli_missing_config_is_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "cost", "kv", "--model", str(tmp_path), "--tokens", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr == f"kvledger: error: no model config at {tmp_path / 'config.json'}\n"


# --------------------------------------------------------------------------- cost report


def test_served_cost_prices_actual_usage_as_the_model_prices_a_later_request():
    prices = Prices(input=1.0, cached_input=0.1, output=2.0)
    usage = {"tenant_id": "acme", "num_requests": 100, "num_prompt_tokens": 1_000_000, "num_cached_tokens": 792_000,
             "num_output_tokens": 50_000}  # fmt: skip
    cost = served_cost(usage, prices)
    assert cost.cost_without_cache_usd == pytest.approx(1.0 + 0.1, abs=1e-12)
    assert cost.cost_with_cache_usd == pytest.approx(0.208 + 0.0792 + 0.1, abs=1e-12)
    assert cost.net_saving_usd == pytest.approx(1.1 - 0.3872, abs=1e-12)
    assert cost.hit_ratio_tokens == 0.792
    # the worked example's N requests served as the model assumes (the first writes the prefix at
    # the input price, 99 hit it) cost exactly what the model says
    example = estimate_cost(**WORKED_EXAMPLE)
    assert cost.cost_with_cache_usd == pytest.approx(example.cost_with_cache_usd, abs=1e-12)
    assert cost.cost_without_cache_usd == pytest.approx(example.cost_without_cache_usd, abs=1e-12)
    with pytest.raises(ValueError, match="inconsistent"):
        served_cost(usage | {"num_cached_tokens": 1_000_001}, prices)


def test_prices_come_from_a_file_and_flags_override_it(tmp_path):
    prices_file = tmp_path / "prices.json"
    prices_file.write_text(json.dumps({"input": 3, "cached_input": 0.3, "output": 15}))
    assert load_prices(
        str(prices_file), {"input": None, "cached_input": None, "output": None}
    ) == Prices(3, 0.3, 15)
    assert load_prices(
        str(prices_file), {"input": 1.0, "cached_input": None, "output": None}
    ) == Prices(1.0, 0.3, 15)
    with pytest.raises(
        ValueError,
        match=r"missing prices: cached_input, output \(pass --price-cached-input, --price-output",
    ):
        load_prices(None, {"input": 1.0, "cached_input": None, "output": None})
    prices_file.write_text(
        json.dumps({"input": 3, "cached_input": 0.3, "output": 15, "storage": 1})
    )
    with pytest.raises(ValueError, match="only the keys"):
        load_prices(str(prices_file), {})
    prices_file.write_text(json.dumps({"input": -1, "cached_input": 0.3, "output": 15}))
    with pytest.raises(ValueError, match="price input must be a non-negative number"):
        load_prices(str(prices_file), {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", timedelta(seconds=90)), ("30m", timedelta(minutes=30)), ("2h", timedelta(hours=2)), ("7d", timedelta(days=7)),
     ("1h30m", timedelta(minutes=90))],
)  # fmt: skip
def test_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "1", "h", "1.5h", "-1h", "1w", "1h 30m", "30m1"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(text)


def test_cost_report_without_prices_is_one_line_and_exit_2(capsys):
    assert (
        main(
            [
                "cost",
                "report",
                "--since",
                "1h",
                "--price-input",
                "1",
                "--coordinator-url",
                "http://127.0.0.1:9",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err
        == "kvledger: error: missing prices: cached_input, output (pass --price-cached-input, --price-output or put them in --prices)\n"
    )
