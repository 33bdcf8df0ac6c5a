"""``kvledger cost model|kv|report``: what a prompt cache saves, and what its KV state weighs.

Two estimates an operator needs before turning a prefix into a shared cache entry, and
one account of what the cache did save:

* ``model``: the token-level cost of N requests with and without the cache. The
  first request computes the whole prompt (its H prefix tokens are what it writes
  to the cache, at the cache-write price when the provider charges one); each later
  request pays the cached price for H tokens and the normal price for the other
  P - H; output tokens cost the same either way. Storage and management cost is
  subtracted as given, because a cache that saves tokens but costs more to keep
  is not an optimisation.
* ``kv``: the raw K and V tensor bytes per token, read from the model's
  ``config.json`` (layers × 2 × KV heads × head dim × element bytes), times T
  tokens and B sequences — why a long shared prefix kept on the GPU can exhaust
  its memory even while it saves prefill.
* ``report``: the ``model``'s prices applied to what the nodes actually served each
  tenant over a window (``GET /v1/usage`` of the coordinator, summed from the nodes'
  ``UsageReported`` records): prompt tokens at the input price without the cache; the
  uncached ones at the input price and the cached ones at the cached price with it.

Pure functions carry the arithmetic (so tests can pin the worked examples); the
``*_cli`` functions only parse, call and print. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from identity.roles import PLATFORM_ADMIN
from kvledger.api import Coordinator

TOKENS_PER_PRICE_UNIT = 1_000_000
"""Prices are in USD per million tokens, as providers quote them."""

DTYPE_BYTES = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "tfloat32": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
DEFAULT_DTYPE = "bfloat16"
"""What a config without a dtype is served in: half precision, 2 bytes an element."""


@dataclass(frozen=True)
class CostEstimate:
    """The cost of N requests in USD, with and without a shared prefix in the cache."""

    cost_without_cache_usd: float
    cost_with_cache_usd: float
    storage_cost_usd: float
    net_saving_usd: float
    """Without minus with minus storage: the effective saving; positive means the cache pays for
    itself."""
    saving_ratio: float
    """Net saving as a share of the cost without cache."""
    reusable_token_ratio: float
    """H / P: the share of each prompt the cache can serve."""


def _usd(tokens: float, price_per_million: float) -> float:
    return tokens * price_per_million / TOKENS_PER_PRICE_UNIT


def prompt_cost_usd(
    num_uncached_tokens: int, num_cached_tokens: int, price_input: float, price_cached_input: float
) -> float:
    """What prompt tokens cost: the uncached ones at the input price, the cached ones at the cached
    price."""
    return _usd(num_uncached_tokens, price_input) + _usd(num_cached_tokens, price_cached_input)


def estimate_cost(
    *,
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    num_requests: int,
    price_input: float,
    price_cached_input: float,
    price_output: float,
    price_cache_write: float | None = None,
    storage_cost_usd: float = 0.0,
) -> CostEstimate:
    """The cost of ``num_requests`` requests of ``prompt_tokens`` (the first ``cached_tokens`` a stable prefix).

    ``price_cache_write`` (per million) replaces the input price for the prefix tokens the
    first request writes to the cache; without it the write costs what any input costs.
    ValueError on counts or prices that describe no real workload.
    """
    for name, value in (
        ("prompt tokens", prompt_tokens),
        ("cached tokens", cached_tokens),
        ("output tokens", output_tokens),
        ("input price", price_input),
        ("cached input price", price_cached_input),
        ("output price", price_output),
        ("storage cost", storage_cost_usd),
    ):
        if value < 0:
            raise ValueError(f"{name} must not be negative (got {value})")
    if price_cache_write is not None and price_cache_write < 0:
        raise ValueError(f"cache write price must not be negative (got {price_cache_write})")
    if num_requests < 1:
        raise ValueError(f"requests must be at least 1 (got {num_requests})")
    if prompt_tokens < 1:
        raise ValueError(f"prompt tokens must be at least 1 (got {prompt_tokens})")
    if cached_tokens > prompt_tokens:
        raise ValueError(
            f"cached tokens ({cached_tokens}) cannot exceed prompt tokens ({prompt_tokens})"
        )

    uncached_tokens = prompt_tokens - cached_tokens
    output_usd = num_requests * _usd(output_tokens, price_output)
    without_cache = (
        num_requests * prompt_cost_usd(prompt_tokens, 0, price_input, price_cached_input)
        + output_usd
    )
    write_price = price_input if price_cache_write is None else price_cache_write
    first_request = _usd(uncached_tokens, price_input) + _usd(cached_tokens, write_price)
    later_request = prompt_cost_usd(uncached_tokens, cached_tokens, price_input, price_cached_input)
    with_cache = first_request + (num_requests - 1) * later_request + output_usd
    net_saving = without_cache - with_cache - storage_cost_usd
    return CostEstimate(
        cost_without_cache_usd=without_cache,
        cost_with_cache_usd=with_cache,
        storage_cost_usd=storage_cost_usd,
        net_saving_usd=net_saving,
        saving_ratio=net_saving / without_cache if without_cache else 0.0,
        reusable_token_ratio=cached_tokens / prompt_tokens,
    )


@dataclass(frozen=True)
class KvShape:
    """What one token's K and V cost in memory, from a model config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _positive_int(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config {key} must be a positive integer (got {value!r})")
    return value


def kv_shape(config: dict[str, Any], dtype: str | None = None) -> KvShape:
    """The KV shape of a Hugging Face ``config.json`` (a multimodal one's ``text_config`` when it has no layers itself).

    KV heads fall back to attention heads (no GQA), the head dim to hidden size / attention
    heads, the dtype (``dtype`` overrides ``torch_dtype``/``dtype``) to half precision.
    ValueError when the config lacks what the size depends on.
    """
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    num_layers = _positive_int(config, "num_hidden_layers")
    num_attention_heads = _positive_int(config, "num_attention_heads")
    if num_layers is None or num_attention_heads is None:
        raise ValueError(
            "config has no num_hidden_layers or num_attention_heads: not a decoder-only Transformer config"
        )
    num_kv_heads = _positive_int(config, "num_key_value_heads") or num_attention_heads
    head_dim = _positive_int(config, "head_dim")
    if head_dim is None:
        hidden_size = _positive_int(config, "hidden_size")
        if hidden_size is None or hidden_size % num_attention_heads:
            raise ValueError(
                "config has no head_dim, and hidden_size does not divide into num_attention_heads"
            )
        head_dim = hidden_size // num_attention_heads
    dtype_name = str(
        dtype or config.get("torch_dtype") or config.get("dtype") or DEFAULT_DTYPE
    ).removeprefix("torch.")
    if dtype_name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype_name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return KvShape(num_layers, num_kv_heads, head_dim, dtype_name, DTYPE_BYTES[dtype_name])


def load_config(model_dir: str | None, config_file: str | None) -> dict[str, Any]:
    """The model's ``config.json`` as a dict (``model_dir/config.json`` or ``config_file``).

    FileNotFoundError when it is missing; ValueError when it is not a JSON object.
    """
    path = Path(config_file) if config_file else Path(model_dir or "") / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no model config at {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")  # noqa: TRY004 - a bad file is bad input, reported as such
    return config


def _amount(value: float) -> str:
    """A money or ratio value with no float noise (0.38720000000000004 → 0.3872)."""
    return f"{value:.10g}"


def model_cli(args: argparse.Namespace) -> int:
    estimate = estimate_cost(
        prompt_tokens=args.prompt_tokens,
        cached_tokens=args.cached_tokens,
        output_tokens=args.output_tokens,
        num_requests=args.requests,
        price_input=args.price_input,
        price_cached_input=args.price_cached_input,
        price_output=args.price_output,
        price_cache_write=args.price_cache_write,
        storage_cost_usd=args.storage_cost,
    )
    if args.json:
        print(
            json.dumps(
                {name: round(value, 10) for name, value in asdict(estimate).items()}, indent=2
            )
        )
        return 0
    print(f"cost without cache    {_amount(estimate.cost_without_cache_usd)} USD")
    print(f"cost with cache       {_amount(estimate.cost_with_cache_usd)} USD")
    print(f"storage cost          {_amount(estimate.storage_cost_usd)} USD")
    print(
        f"net saving            {_amount(estimate.net_saving_usd)} USD ({estimate.saving_ratio:.1%} of the cost without cache)"
    )
    print(f"reusable token ratio  {_amount(estimate.reusable_token_ratio)}")
    if estimate.net_saving_usd <= 0:
        print("the cache does not pay for itself under these prices")
    return 0


def kv_cli(args: argparse.Namespace) -> int:
    if args.tokens < 0 or args.batch < 1:
        raise ValueError("--tokens must not be negative and --batch must be at least 1")
    shape = kv_shape(load_config(args.model_dir, args.config), args.dtype)
    total_bytes = shape.bytes_per_token * args.tokens * args.batch
    if args.json:
        print(
            json.dumps(
                asdict(shape)
                | {
                    "bytes_per_token": shape.bytes_per_token,
                    "tokens": args.tokens,
                    "batch": args.batch,
                    "total_bytes": total_bytes,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"layers {shape.num_layers} × 2 (K, V) × KV heads {shape.num_kv_heads} × head dim {shape.head_dim} × {shape.dtype} {shape.dtype_bytes} B"
    )
    print(f"per token             {shape.bytes_per_token:,} bytes")
    print(
        f"{args.tokens:,} tokens × {args.batch}  {total_bytes:,} bytes = {total_bytes / 1e9:.2f} GB = {total_bytes / 2**30:.2f} GiB"
    )
    return 0


@dataclass(frozen=True)
class Prices:
    """USD per million tokens."""

    input: float
    cached_input: float
    output: float

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"price {name} must be a non-negative number (got {value!r})")


PRICE_FLAGS = {
    "input": "price_input",
    "cached_input": "price_cached_input",
    "output": "price_output",
}
"""Price name in a prices file → the argparse dest of the flag that overrides it."""


def load_prices(prices_file: str | None, overrides: dict[str, float | None]) -> Prices:
    """Prices from a JSON file (``{"input": 1, "cached_input": 0.1, "output": 2}``), each overridden by its flag.

    ValueError when a price is missing from both, the file holds anything else, or a price is negative.
    """
    prices: dict = {}
    if prices_file is not None:
        text = Path(prices_file).read_text(encoding="utf-8")
        try:
            prices = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{prices_file}: not JSON ({error})") from None
        if not isinstance(prices, dict) or set(prices) - set(PRICE_FLAGS):
            raise ValueError(
                f"{prices_file}: expected a JSON object with only the keys {', '.join(PRICE_FLAGS)}"
            )
    prices |= {name: value for name, value in overrides.items() if value is not None}
    missing = [name for name in PRICE_FLAGS if name not in prices]
    if missing:
        flags = ", ".join(f"--{PRICE_FLAGS[name].replace('_', '-')}" for name in missing)
        raise ValueError(
            f"missing prices: {', '.join(missing)} (pass {flags} or put them in --prices)"
        )
    return Prices(**prices)


@dataclass(frozen=True)
class ServedCost:
    """What one tenant's served tokens cost, without and with the cache."""

    tenant_id: str
    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    cost_without_cache_usd: float
    cost_with_cache_usd: float
    net_saving_usd: float
    hit_ratio_tokens: float


def served_cost(usage: dict, prices: Prices) -> ServedCost:
    """Price one tenant's usage (a row of ``GET /v1/usage``) with :func:`prompt_cost_usd`, as the model does."""
    num_prompt, num_cached, num_output = (
        usage["num_prompt_tokens"],
        usage["num_cached_tokens"],
        usage["num_output_tokens"],
    )
    if not 0 <= num_cached <= num_prompt or num_output < 0:
        raise ValueError(
            f"usage of {usage['tenant_id']!r} is inconsistent: {num_cached} cached of {num_prompt} prompt tokens"
        )
    output_usd = _usd(num_output, prices.output)
    without_cache = prompt_cost_usd(num_prompt, 0, prices.input, prices.cached_input) + output_usd
    with_cache = (
        prompt_cost_usd(num_prompt - num_cached, num_cached, prices.input, prices.cached_input)
        + output_usd
    )
    return ServedCost(
        tenant_id=usage["tenant_id"],
        num_requests=usage["num_requests"],
        num_prompt_tokens=num_prompt,
        num_cached_tokens=num_cached,
        num_output_tokens=num_output,
        cost_without_cache_usd=without_cache,
        cost_with_cache_usd=with_cache,
        net_saving_usd=without_cache - with_cache,
        hit_ratio_tokens=num_cached / num_prompt if num_prompt else 0.0,
    )


_DURATION_PART = re.compile(r"(\d+)([smhd])")
_DURATION_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``2h``, ``7d`` or a sum of them (``1h30m``); ValueError otherwise."""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"bad duration {text!r}: expected e.g. 90s, 30m, 2h, 7d or 1h30m")
    return timedelta(seconds=sum(int(number) * _DURATION_UNIT_S[unit] for number, unit in parts))


def report_cli(args: argparse.Namespace) -> int:
    prices = load_prices(
        args.prices, {name: getattr(args, dest) for name, dest in PRICE_FLAGS.items()}
    )
    since = datetime.now(UTC) - parse_duration(args.since)
    params = {"since": since.isoformat()} | ({"tenant": args.tenant} if args.tenant else {})
    usage = Coordinator(args, role=PLATFORM_ADMIN, tenant="platform").json(
        "GET", "/v1/usage", params=params
    )
    costs = [served_cost(row, prices) for row in usage["tenants"]]
    total = served_cost(
        {"tenant_id": "total"}
        | {
            name: sum(row[name] for row in usage["tenants"])
            for name in (
                "num_requests",
                "num_prompt_tokens",
                "num_cached_tokens",
                "num_output_tokens",
            )
        },
        prices,
    )
    if args.json:

        def rounded(cost: ServedCost) -> dict:
            return {
                name: round(value, 10) if isinstance(value, float) else value
                for name, value in asdict(cost).items()
            }

        print(
            json.dumps(
                {
                    "since": usage["since"],
                    "until": usage["until"],
                    "prices": asdict(prices),
                    "tenants": [rounded(cost) for cost in costs],
                    "total": rounded(total),
                },
                indent=2,
            )
        )
        return 0
    print(
        f"served {usage['since']} .. {usage['until']}; USD per million tokens: input {_amount(prices.input)}, "
        f"cached input {_amount(prices.cached_input)}, output {_amount(prices.output)}"
    )
    header = (
        "tenant",
        "requests",
        "prompt",
        "cached",
        "output",
        "hit ratio",
        "without cache",
        "with cache",
        "saving",
    )
    rows = [
        (
            cost.tenant_id,
            str(cost.num_requests),
            str(cost.num_prompt_tokens),
            str(cost.num_cached_tokens),
            str(cost.num_output_tokens),
            f"{cost.hit_ratio_tokens:.1%}",
            _amount(cost.cost_without_cache_usd),
            _amount(cost.cost_with_cache_usd),
            _amount(cost.net_saving_usd),
        )
        for cost in [*costs, total]
    ]
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                cell.ljust(width) if column == 0 else cell.rjust(width)
                for column, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        )
    if not costs:
        print("no usage reported in this window")
    return 0
