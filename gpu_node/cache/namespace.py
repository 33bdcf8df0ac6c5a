"""The cache namespace of a model directory: everything that makes KV incompatible.

Two nodes may exchange KV blocks only if they would have computed the same keys and
values for the same tokens. That depends on the weights, on how text becomes tokens
(tokenizer files and special tokens), on how messages become text (chat template), on
any adapter, on the parts of the model config that shape attention (architecture, rope,
positions, head dims, layer count, attention implementation) and on the KV storage
format (dtype, layout version, block size). The namespace is a digest over a digest of
each of those, in a fixed order; it is the root of every block key
(``prefix_keys.blocks.namespace_root``), so anything that differs can never share a key.

Hashing multi-gigabyte safetensors shards on every start would be slow, so per-file
digests are cached by (name, size, mtime_ns) in a small JSON file inside the model
directory, falling back to an in-process cache when that directory is read-only
(e.g. a mounted model volume).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prefix_keys.model_files import chat_templates, read_json_object

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = ".kvledger-digests.json"
_CACHE_VERSION = 1
_NAMESPACE_DOMAIN = b"kvledger/namespace/v1\x00"

# Files whose bytes define tokenization. tokenizer_config.json is digested separately
# (canonicalised, without its chat template) because it also carries the template.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "added_tokens.json",
    "special_tokens_map.json",
)
_TOKENIZER_VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model")

# config.json keys that cannot change KV. Everything else is digested: an unknown key
# splitting a namespace only costs reuse, while a KV-relevant key left out would let
# incompatible blocks share keys. ``attn_implementation`` is replaced by the value the
# node actually runs with; the compute dtype is part of ``kv_format``.
_CONFIG_KEYS_WITHOUT_KV_EFFECT = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "attn_implementation",
        "_attn_implementation",
        "dtype",
        "torch_dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
# Legacy top-level rope keys that transformers 5 folds into ``rope_parameters``.
_LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor")

_U32 = struct.Struct("<I")

# (resolved path, size, mtime_ns) -> sha256 hex. Filled on every hash; it is what keeps
# a read-only model directory (no JSON cache) from being re-hashed on every call.
_PROCESS_CACHE: dict[tuple[str, int, int], str] = {}


@dataclass(frozen=True, slots=True)
class NamespaceIdentity:
    """A namespace and the component digests it was computed from (kept for diagnostics:
    when two nodes disagree, the components say whether weights, tokenizer, template,
    adapter, config or KV format differ)."""

    namespace: str
    weights_digest: str
    tokenizer_digest: str
    template_digest: str
    adapter_digest: str | None
    config_digest: str
    kv_format: str


def compute_namespace(
    model_dir: Path,
    kv_format: str,
    attn_implementation: str,
    adapter_dir: Path | None = None,
) -> NamespaceIdentity:
    """Digest everything under ``model_dir`` (and ``adapter_dir``) that changes KV.

    ``kv_format`` is the storage format string (``KVBlockSpec.kv_format``: dtype, layout
    version, block size); ``attn_implementation`` is the one the loaded model runs with.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist")
    if not kv_format:
        raise ValueError("kv_format must be non-empty")
    if not attn_implementation:
        raise ValueError("attn_implementation must be non-empty")

    model_files = _DigestCache(model_dir)
    weights = _weights_digest(model_dir, model_files)
    tokenizer_config = read_json_object(model_dir / "tokenizer_config.json")
    tokenizer = _tokenizer_digest(model_dir, model_files, tokenizer_config)
    model_files.save()
    template = _template_digest(model_dir, tokenizer_config)
    config = _config_digest(model_dir, attn_implementation)
    adapter = None if adapter_dir is None else _adapter_digest(Path(adapter_dir))

    h = hashlib.sha256(_NAMESPACE_DOMAIN)
    for label, value in (
        ("weights", weights),
        ("tokenizer", tokenizer),
        ("template", template),
        ("adapter", adapter or ""),
        ("config", config),
        ("kv_format", kv_format),
    ):
        h.update(_field(label.encode()))
        h.update(_field(value.encode()))
    return NamespaceIdentity(
        namespace=h.hexdigest(),
        weights_digest=weights,
        tokenizer_digest=tokenizer,
        template_digest=template,
        adapter_digest=adapter,
        config_digest=config,
        kv_format=kv_format,
    )


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _canonical_json(value: object) -> bytes:
    """Sorted keys, no whitespace, integral floats as ints (``1e4`` == ``10000``)."""
    return json.dumps(
        _normalise_numbers(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


def _normalise_numbers(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _normalise_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_normalise_numbers(item) for item in value]
    return value


def _sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _save_cache_file(path: Path, entries: dict) -> None:
    """Atomically replace the JSON digest cache (readers never see a partial file)."""
    payload = json.dumps({"version": _CACHE_VERSION, "files": entries}, sort_keys=True, indent=1)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


class _DigestCache:
    """Per-directory sha256 of files, reused while a file's (size, mtime_ns) is unchanged."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / CACHE_FILE_NAME
        self._entries = self._load()
        self._dirty = False

    def _load(self) -> dict:
        # A missing, unreadable or foreign cache file just means "hash again".
        try:
            data = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
            return {}
        if not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def digest(self, path: Path) -> str:
        stat = path.stat()
        entry = self._entries.get(path.name)
        if (
            isinstance(entry, dict)
            and entry.get("size") == stat.st_size
            and entry.get("mtime_ns") == stat.st_mtime_ns
            and isinstance(entry.get("sha256"), str)
        ):
            return entry["sha256"]
        process_key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        digest = _PROCESS_CACHE.get(process_key)
        if digest is None:
            digest = _sha256_file(path)
            _PROCESS_CACHE[process_key] = digest
        self._entries[path.name] = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "sha256": digest,
        }
        self._dirty = True
        return digest

    def save(self) -> None:
        if not self._dirty:
            return
        try:
            _save_cache_file(self._path, self._entries)
        except OSError as exc:
            logger.info(
                "digest cache %s not writable (%s); using the in-process cache", self._path, exc
            )
        self._dirty = False


def _files_digest(named_digests: Iterable[tuple[str, str]]) -> str:
    """sha256 over (name, digest) pairs, each length-prefixed, in the given order."""
    h = hashlib.sha256()
    for name, digest in named_digests:
        h.update(_field(name.encode()))
        h.update(_field(digest.encode()))
    return h.hexdigest()


def _weights_digest(directory: Path, cache: _DigestCache) -> str:
    shards = sorted(path for path in directory.glob("*.safetensors") if path.is_file())
    if not shards:
        raise ValueError(f"{directory} holds no *.safetensors weights")
    return _files_digest((shard.name, cache.digest(shard)) for shard in shards)


def _tokenizer_digest(model_dir: Path, cache: _DigestCache, tokenizer_config: dict | None) -> str:
    if not any((model_dir / name).is_file() for name in _TOKENIZER_VOCABULARY_FILES):
        raise ValueError(
            f"{model_dir} holds no tokenizer ({', '.join(_TOKENIZER_VOCABULARY_FILES)})"
        )
    parts = [
        (name, cache.digest(model_dir / name))
        for name in _TOKENIZER_FILES
        if (model_dir / name).is_file()
    ]
    # Special tokens and tokenizer options live in tokenizer_config.json next to the
    # chat template; the template has its own component, so it is left out here.
    settings = {
        key: value for key, value in (tokenizer_config or {}).items() if key != "chat_template"
    }
    parts.append(("tokenizer_config.json", hashlib.sha256(_canonical_json(settings)).hexdigest()))
    return _files_digest(parts)


def _template_digest(model_dir: Path, tokenizer_config: dict | None) -> str:
    """Digest of the chat template(s) transformers would load from ``model_dir`` (by name;
    a model without a template digests to the empty template list)."""
    templates = chat_templates(model_dir, tokenizer_config)
    return hashlib.sha256(_canonical_json(templates)).hexdigest()


def _canonical_config(config: dict, attn_implementation: str) -> dict:
    canonical = {
        key: value for key, value in config.items() if key not in _CONFIG_KEYS_WITHOUT_KV_EFFECT
    }
    # Fold legacy rope keys into the transformers 5 ``rope_parameters`` shape, so a config
    # written by an older transformers digests like the same config re-saved by a newer one.
    rope = dict(canonical.pop("rope_parameters", None) or {})
    for key in _LEGACY_ROPE_KEYS:
        value = canonical.pop(key, None)
        if isinstance(value, dict):
            rope.update(value)
        elif value is not None:
            rope[key] = value
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    if rope:
        rope.setdefault("rope_type", "default")
        canonical["rope_parameters"] = rope
    canonical["attn_implementation"] = attn_implementation
    return canonical


def _config_digest(model_dir: Path, attn_implementation: str) -> str:
    config = read_json_object(model_dir / "config.json")
    if config is None:
        raise ValueError(f"{model_dir} holds no config.json")
    return hashlib.sha256(
        _canonical_json(_canonical_config(config, attn_implementation))
    ).hexdigest()


def _adapter_digest(adapter_dir: Path) -> str:
    """Adapter config (canonical JSON) plus its safetensors weights, cached like the model's."""
    if not adapter_dir.is_dir():
        raise ValueError(f"adapter directory {adapter_dir} does not exist")
    adapter_config = read_json_object(adapter_dir / "adapter_config.json")
    if adapter_config is None:
        raise ValueError(f"{adapter_dir} holds no adapter_config.json")
    cache = _DigestCache(adapter_dir)
    weights = _weights_digest(adapter_dir, cache)
    cache.save()
    return _files_digest(
        [
            ("adapter_config.json", hashlib.sha256(_canonical_json(adapter_config)).hexdigest()),
            ("weights", weights),
        ]
    )
