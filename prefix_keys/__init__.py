"""Block keys of a chat request, derived the same way by every party that needs them.

From a verified principal, the request's messages, a model's tokenizer and chat template, the
namespace digest and the block size to the chained block keys with their scopes and
provenance: ``prompt`` renders and tokenizes per message, ``blocks`` salts and hashes,
``chat_template`` renders templates as transformers does, ``model_files`` loads a model
directory's tokenizer without transformers. The node serves from these keys; a router
(which must pick the node holding a request's longest cached prefix) computes them from the
same model files without torch, so nothing here may import the ML stack (import-linter
contract ``prefix-keys-no-ml``).
"""
