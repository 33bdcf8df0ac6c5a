"""Node keys for node-to-node requests (a node pulling a peer's blocks, ``gpu_node.cache.peers``).

``GET /v1/nodes/peer-keys/{key_id}`` → ``{key_id, node_id, public_key, namespace}``: an enrolled,
unrevoked node key (raw Ed25519, base64url) and the namespace its node last reported (``null``
before its first kv-event). 404 ``unknown_node_key`` for a key never enrolled or revoked.

Only enrolled nodes may ask, with their own node credential
(``coordinator.keys.node_keys.authenticate_node``): a holder checks a puller's signed request
against the very registry the key service and the consumers trust, read through the same cache, so a
revocation reaches peer pulls within ``ledger.node_key_cache_s`` here plus the holder's own cache of
the answer (``cache.peer_key_cache_s``, the same default). The answer holds public keys and node ids
only."""

from __future__ import annotations

import base64
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request

from coordinator.api.dependencies import Session
from coordinator.http import ApiError
from coordinator.keys.node_keys import EnrolledKey, NodeKeyRegistry, authenticate_node
from coordinator.ledger.models import Node
from identity.signing import raw_public_key

router = APIRouter()

_KEY_ID_PATTERN = r"^[0-9a-f]{32}$"
"""What :func:`identity.signing.key_id` makes."""


async def _peer_caller(request: Request) -> EnrolledKey:
    return await authenticate_node(request, "the peer key registry")


@router.get("/v1/nodes/peer-keys/{key_id}")
async def peer_key(
    request: Request,
    _: Annotated[EnrolledKey, Depends(_peer_caller)],
    session: Session,
    key_id: Annotated[str, Path(pattern=_KEY_ID_PATTERN)],
) -> dict[str, Any]:
    registry: NodeKeyRegistry = request.app.state.node_keys
    enrolled = (await registry.lookup([key_id])).get(key_id)
    if enrolled is None:
        raise ApiError(
            404,
            "invalid_request_error",
            "unknown_node_key",
            "no enrolled, unrevoked node key has this id",
        )
    node = await session.get(Node, enrolled.node_id)
    return {
        "key_id": enrolled.key_id,
        "node_id": enrolled.node_id,
        "public_key": base64.urlsafe_b64encode(raw_public_key(enrolled.public_key))
        .decode()
        .rstrip("="),
        "namespace": None if node is None else node.namespace,
    }
