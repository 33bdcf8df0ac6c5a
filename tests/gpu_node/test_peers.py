"""The pull wire format and the peer list's bounds (``gpu_node.cache.peers``,
``gpu_node.settings.PeerSettings``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpu_node.cache.peers import FRAME_LENGTH, PullFailed, decode_frames, encode_frames
from gpu_node.settings import PeerSettings


def test_frames_round_trip_and_refuse_what_is_cut_oversized_or_too_many():
    records = [b"a" * 10, b"", b"b" * 300]
    data = encode_frames(records)
    assert decode_frames(data, 3, 300) == records
    assert decode_frames(b"", 3, 300) == []
    for bad, max_records, max_record in (
        (data[:-1], 3, 300),
        (data[:2], 3, 300),
        (data, 2, 300),
        (data, 3, 299),
    ):
        with pytest.raises(PullFailed) as failed:
            decode_frames(bad, max_records, max_record)
        assert failed.value.reason == "malformed"
    assert FRAME_LENGTH.size == 4


def test_the_peer_list_takes_http_urls_only():
    assert PeerSettings(urls={"node-1": "http://10.0.0.2:8100"}).urls == {
        "node-1": "http://10.0.0.2:8100"
    }
    for url in ("file:///etc/passwd", "gopher://x", "http://" + "x" * 2048):
        with pytest.raises(ValidationError):
            PeerSettings(urls={"node-1": url})
    with pytest.raises(ValidationError):
        PeerSettings(urls={"": "http://10.0.0.2"})
