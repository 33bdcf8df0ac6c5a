"""A router computes block keys without the node's ML stack: prefix_keys never loads torch.

import-linter's ``prefix-keys-no-ml`` contract checks the imports it can see; this runs the
whole router path in a fresh interpreter (load a model directory, render, hash) and looks at
what ended up in ``sys.modules``, so an import hidden behind a third-party package counts too.
"""

from __future__ import annotations

import json
import subprocess
import sys

ML_MODULES = ("torch", "transformers", "numpy", "safetensors", "gguf", "accelerate")

ROUTER_PATH = """
import json, sys
from identity.tokens import Principal
from prefix_keys.blocks import CacheScope, compute_block_keys
from prefix_keys.model_files import load_chat_tokenizer
from prefix_keys.prompt import ChatMessage, render_prompt

tokenizer = load_chat_tokenizer(sys.argv[1])
messages = [ChatMessage("system", "You are terse.", CacheScope.PUBLIC), ChatMessage("user", "hi")]
prompt = render_prompt(tokenizer, messages)
keys = compute_block_keys("ns", prompt.token_ids, prompt.segments, Principal("acme", "u1"), 4)
print(json.dumps({"num_keys": len(keys), "loaded": [m for m in sys.argv[2:] if m in sys.modules]}))
"""


def test_router_path_loads_no_ml_module(tiny_model_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", ROUTER_PATH, str(tiny_model_dir), *ML_MODULES],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["num_keys"] > 0
    assert report["loaded"] == []
