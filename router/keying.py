"""A request's block keys, computed as the node that serves it will compute them.

Each node advertises its model name, namespace, block size and the digest of its tokenizer and
chat template files (``GET /v1/kvledger/keying``, behind the metrics token). The router loads the
same model directory (``prefix_keys.model_files.load_chat_tokenizer``) and keys a node only when
both name the same model and their digests are equal (``prefix_keys.model_files.keying_digest``):
a node it cannot key is never sent a request, and a model no node can be keyed for is refused.
Messages are mapped the way the node's API maps them (``prefix_keys.prompt.request_message``);
a request the router cannot key at all (a body the node will refuse) is routed without keys, and
the node answers its error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from identity.tokens import Principal
from prefix_keys.blocks import CacheScope, DocumentRef, compute_block_keys
from prefix_keys.model_files import keying_digest, load_chat_tokenizer
from prefix_keys.prompt import ChatMessage, render_prompt, request_message
from router.settings import NodeEndpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeKeying:
    """What a node keys blocks with (its ``/v1/kvledger/keying`` answer)."""

    model: str
    namespace: str
    block_size: int
    keying_digest: str


def request_messages(body: Mapping) -> list[ChatMessage]:
    """The messages of a chat-completions body as the node maps them; ValueError/KeyError/TypeError for a body it would refuse."""
    messages = []
    for message in body["messages"]:
        content = message["content"]
        text = content if isinstance(content, str) else "".join(part["text"] for part in content)
        if not isinstance(text, str):
            raise TypeError("message content must be text")
        document = message.get("document")
        ref = (
            None
            if document is None
            else DocumentRef(
                str(document["id"]), int(document["version"]), str(document["auth_scope"])
            )
        )
        messages.append(
            request_message(
                str(message["role"]),
                text,
                CacheScope.parse(message.get("cache_scope", "user")),
                ref,
            )
        )
    return messages


class Keying:
    """The router's model, and which nodes it can key (refreshed from the nodes)."""

    def __init__(self, model_dir: Path, model: str) -> None:
        self.model = model
        self.tokenizer = load_chat_tokenizer(model_dir)
        self.digest = keying_digest(model_dir)
        self.nodes: dict[str, NodeKeying] = {}
        self._refused: dict[str, str] = {}

    async def refresh(
        self, http: httpx.AsyncClient, endpoints: Iterable[NodeEndpoint], metrics_token: str | None
    ) -> None:
        """Ask every node how it keys; keep the ones this router can key. A node that does not answer keeps its last answer."""
        headers = {} if metrics_token is None else {"Authorization": f"Bearer {metrics_token}"}
        for endpoint in endpoints:
            try:
                response = await http.get(f"{endpoint.url}/v1/kvledger/keying", headers=headers)
                response.raise_for_status()
                data = response.json()
                keying = NodeKeying(
                    str(data["model"]),
                    str(data["namespace"]),
                    int(data["block_size"]),
                    str(data["keying_digest"]),
                )
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
                log.info(
                    "router: %s did not say how it keys blocks (%s)",
                    endpoint.node_id,
                    type(error).__name__,
                )
                continue
            problem = None
            if keying.model != self.model:
                problem = f"serves model {keying.model!r}, the router keys {self.model!r}"
            elif keying.keying_digest != self.digest:
                problem = "its tokenizer or chat template differs from the router's model directory"
            if problem is None:
                self.nodes[endpoint.node_id] = keying
                self._refused.pop(endpoint.node_id, None)
            else:
                self.nodes.pop(endpoint.node_id, None)
                if self._refused.get(endpoint.node_id) != problem:
                    log.warning("router: not routing to %s: %s", endpoint.node_id, problem)
                self._refused[endpoint.node_id] = problem

    def keys(
        self, principal: Principal, messages: list[ChatMessage]
    ) -> dict[tuple[str, int], list[bytes]]:
        """The block hashes of the request under every (namespace, block size) a keyed node uses.

        Blocking and CPU-bound (rendering and tokenizing): callers run it on a worker thread.
        ValueError for messages the template or the key derivation refuses.
        """
        prompt = render_prompt(self.tokenizer, messages)
        keys = {}
        for keying in self.nodes.values():
            space = (keying.namespace, keying.block_size)
            if space not in keys:
                derived = compute_block_keys(
                    keying.namespace,
                    prompt.token_ids,
                    prompt.segments,
                    principal,
                    keying.block_size,
                    now=0.0,
                )
                keys[space] = [key.block_hash for key in derived]
        return keys
