from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gpu_node.cache import namespace as ns
from gpu_node.cache.namespace import CACHE_FILE_NAME, NamespaceIdentity, compute_namespace

KV = "float32/L1/bs16"  # KVBlockSpec.kv_format spelling


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path, monkeypatch) -> Path:
    """A private, mutable copy of the tiny model, with a cold in-process digest cache."""
    monkeypatch.setattr(ns, "_PROCESS_CACHE", {})
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target, ignore=shutil.ignore_patterns(CACHE_FILE_NAME))
    return target


def _no_hashing(path):
    raise AssertionError(f"{path.name} was re-hashed")


def _rewrite_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def test_identity_shape_and_stability(model_copy):
    first = compute_namespace(model_copy, KV, "sdpa")
    again = compute_namespace(model_copy, KV, "sdpa")
    assert isinstance(first, NamespaceIdentity)
    assert first == again
    assert len(first.namespace) == 64 and int(first.namespace, 16) >= 0
    assert first.adapter_digest is None
    assert first.kv_format == KV
    assert (
        len(
            {
                first.weights_digest,
                first.tokenizer_digest,
                first.template_digest,
                first.config_digest,
            }
        )
        == 4
    )


def test_identical_builds_share_a_namespace(model_copy, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(model_copy, other)
    assert compute_namespace(model_copy, KV, "sdpa") == compute_namespace(other, KV, "sdpa")


def test_weights_digest_is_length_prefixed_sha256_over_sorted_shards(model_copy):
    import hashlib

    blob = (model_copy / "model.safetensors").read_bytes()
    expected = hashlib.sha256()
    for part in (b"model.safetensors", hashlib.sha256(blob).hexdigest().encode()):
        expected.update(len(part).to_bytes(4, "little") + part)
    assert compute_namespace(model_copy, KV, "sdpa").weights_digest == expected.hexdigest()


def _changed_component(model_copy: Path, change) -> set[str]:
    before = compute_namespace(model_copy, KV, "sdpa")
    result = change(model_copy)  # file edits return byte counts; argument changes return a dict
    kwargs = result if isinstance(result, dict) else {}
    after = compute_namespace(
        model_copy, kwargs.get("kv_format", KV), kwargs.get("attn", "sdpa"), kwargs.get("adapter")
    )
    assert after.namespace != before.namespace
    fields = (
        "weights_digest",
        "tokenizer_digest",
        "template_digest",
        "adapter_digest",
        "config_digest",
        "kv_format",
    )
    return {field for field in fields if getattr(before, field) != getattr(after, field)}


def _flip_weight_byte(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_tokenizer_json(directory: Path) -> None:
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"][-1]["content"] = "<|end_of_turn|>"
    path.write_text(json.dumps(data))


def _make_adapter(directory: Path) -> dict:
    adapter = directory.parent / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"not really tensors")
    return {"adapter": adapter}


@pytest.mark.parametrize(
    ("change", "component"),
    [
        (_flip_weight_byte, "weights_digest"),
        (
            lambda d: (d / "model-00002-of-00002.safetensors").write_bytes(b"extra shard"),
            "weights_digest",
        ),
        (_edit_tokenizer_json, "tokenizer_digest"),
        (
            lambda d: _rewrite_json(d / "tokenizer_config.json", eos_token="<|end|>"),
            "tokenizer_digest",
        ),
        (
            lambda d: (d / "chat_template.jinja").write_text(
                "{{ bos_token }}{{ messages[0]['content'] }}"
            ),
            "template_digest",
        ),
        (_make_adapter, "adapter_digest"),
        (
            lambda d: _rewrite_json(
                d / "config.json", rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}
            ),
            "config_digest",
        ),
        (lambda d: _rewrite_json(d / "config.json", max_position_embeddings=8192), "config_digest"),
        (lambda d: _rewrite_json(d / "config.json", num_hidden_layers=3), "config_digest"),
        (lambda d: _rewrite_json(d / "config.json", head_dim=16), "config_digest"),
        (lambda d: {"attn": "eager"}, "config_digest"),
        (lambda d: {"kv_format": "bfloat16/L1/bs16"}, "kv_format"),
        (lambda d: {"kv_format": "float32/L1/bs32"}, "kv_format"),
    ],
)
def test_changing_one_component_changes_only_it_and_the_namespace(model_copy, change, component):
    assert _changed_component(model_copy, change) == {component}


def test_config_keys_without_kv_effect_do_not_split_namespaces(model_copy):
    before = compute_namespace(model_copy, KV, "sdpa")
    _rewrite_json(
        model_copy / "config.json",
        transformers_version="9.9.9",
        use_cache=False,
        attn_implementation="eager",
    )
    assert compute_namespace(model_copy, KV, "sdpa") == before


def test_legacy_rope_keys_canonicalise_like_rope_parameters(model_copy):
    before = compute_namespace(model_copy, KV, "sdpa")
    config = json.loads((model_copy / "config.json").read_text())
    del config["rope_parameters"]
    config["rope_theta"] = 10000
    config["rope_scaling"] = None
    (model_copy / "config.json").write_text(json.dumps(config))
    assert compute_namespace(model_copy, KV, "sdpa").config_digest == before.config_digest


def test_template_in_tokenizer_config_is_digested_when_no_jinja_file(model_copy):
    before = compute_namespace(model_copy, KV, "sdpa")
    template = (model_copy / "chat_template.jinja").read_text()
    (model_copy / "chat_template.jinja").unlink()
    _rewrite_json(model_copy / "tokenizer_config.json", chat_template=template)
    after = compute_namespace(model_copy, KV, "sdpa")
    assert after.template_digest == before.template_digest
    assert after.tokenizer_digest == before.tokenizer_digest


def test_weights_cache_file_is_written_and_hit_without_rehashing(model_copy, monkeypatch):
    first = compute_namespace(model_copy, KV, "sdpa")
    cache = json.loads((model_copy / CACHE_FILE_NAME).read_text())
    entry = cache["files"]["model.safetensors"]
    stat = (model_copy / "model.safetensors").stat()
    assert (entry["size"], entry["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
    assert set(cache["files"]) == {"model.safetensors", "tokenizer.json"}

    # New process (cold in-process cache): digests come from the file, nothing is hashed.
    monkeypatch.setattr(ns, "_PROCESS_CACHE", {})
    monkeypatch.setattr(ns, "_sha256_file", _no_hashing)
    assert compute_namespace(model_copy, KV, "sdpa") == first

    # The cache is trusted while (size, mtime_ns) match: a planted digest is used as is.
    entry["sha256"] = "0" * 64
    (model_copy / CACHE_FILE_NAME).write_text(json.dumps(cache))
    assert compute_namespace(model_copy, KV, "sdpa").weights_digest != first.weights_digest


def test_touched_file_is_rehashed_and_cache_entry_refreshed(model_copy, monkeypatch):
    first = compute_namespace(model_copy, KV, "sdpa")
    weights = model_copy / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    hashed = []
    real_sha256 = ns._sha256_file
    monkeypatch.setattr(
        ns, "_sha256_file", lambda path: hashed.append(path.name) or real_sha256(path)
    )
    assert compute_namespace(model_copy, KV, "sdpa") == first
    assert hashed == ["model.safetensors"]
    cached = json.loads((model_copy / CACHE_FILE_NAME).read_text())["files"]["model.safetensors"]
    assert cached["mtime_ns"] == stat.st_mtime_ns + 1_000_000_000


def test_corrupt_cache_file_is_ignored(model_copy):
    first = compute_namespace(model_copy, KV, "sdpa")
    (model_copy / CACHE_FILE_NAME).write_text("{not json")
    assert compute_namespace(model_copy, KV, "sdpa") == first
    assert json.loads((model_copy / CACHE_FILE_NAME).read_text())["version"] == 1


def test_read_only_directory_uses_in_process_cache(model_copy, monkeypatch):
    def read_only(path, entries):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(ns, "_save_cache_file", read_only)
    first = compute_namespace(model_copy, KV, "sdpa")
    assert not (model_copy / CACHE_FILE_NAME).exists()
    weights = (model_copy / "model.safetensors").resolve()
    stat = weights.stat()
    assert (str(weights), stat.st_size, stat.st_mtime_ns) in ns._PROCESS_CACHE
    monkeypatch.setattr(ns, "_sha256_file", _no_hashing)
    assert compute_namespace(model_copy, KV, "sdpa") == first


@pytest.mark.parametrize("missing", ["model.safetensors", "tokenizer.json", "config.json"])
def test_incomplete_model_directory_is_rejected(model_copy, missing):
    (model_copy / missing).unlink()
    with pytest.raises(ValueError):
        compute_namespace(model_copy, KV, "sdpa")


def test_bad_arguments_are_rejected(model_copy, tmp_path):
    with pytest.raises(ValueError):
        compute_namespace(tmp_path / "absent", KV, "sdpa")
    with pytest.raises(ValueError):
        compute_namespace(model_copy, "", "sdpa")
    with pytest.raises(ValueError):
        compute_namespace(model_copy, KV, "")
    with pytest.raises(ValueError):
        compute_namespace(model_copy, KV, "sdpa", adapter_dir=tmp_path / "no-adapter")
