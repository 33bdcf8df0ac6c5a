"""The pull wire format and the peer list's bounds (``gpu_node.cache.peers``,
``gpu_node.settings.PeerSettings``)."""

from __future__ import annotations

import io
import socket
import threading

import pytest
from pydantic import ValidationError

from gpu_node.cache.peers import (
    FRAME_LENGTH,
    PullFailed,
    frame_chunks,
    frames_length,
    post_for_frames,
    read_frames,
)
from gpu_node.settings import PeerSettings


def test_frames_round_trip_and_refuse_what_is_cut_oversized_or_too_many():
    records = [b"a" * 10, b"", b"b" * 300]
    data = b"".join(frame_chunks(records))
    assert frames_length(records) == len(data) == 3 * FRAME_LENGTH.size + 310
    assert read_frames(io.BytesIO(data), 3, 300) == records
    assert read_frames(io.BytesIO(b""), 3, 300) == []
    for bad, max_records, max_record in (
        (data[:-1], 3, 300),
        (data[:2], 3, 300),
        (data, 2, 300),
        (data, 3, 299),
    ):
        with pytest.raises(PullFailed) as failed:
            read_frames(io.BytesIO(bad), max_records, max_record)
        assert failed.value.reason == "malformed"
    assert FRAME_LENGTH.size == 4


class Trickle(io.RawIOBase):
    """A stream that hands out at most ``step`` bytes per read, as a socket may."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data = memoryview(data)
        self._step = step

    def readinto(self, buffer) -> int:
        num_bytes = min(len(buffer), self._step, len(self._data))
        buffer[:num_bytes] = self._data[:num_bytes]
        self._data = self._data[num_bytes:]
        return num_bytes


def test_frames_arriving_a_few_bytes_at_a_time_are_read_whole():
    records = [bytes(range(256)) * 3, b"x", b""]
    data = b"".join(frame_chunks(records))
    assert read_frames(Trickle(data, 3), 3, 1024) == records


def test_the_peer_list_takes_http_urls_only():
    assert PeerSettings(urls={"node-1": "http://10.0.0.2:8100"}).urls == {
        "node-1": "http://10.0.0.2:8100"
    }
    for url in ("file:///etc/passwd", "gopher://x", "http://" + "x" * 2048):
        with pytest.raises(ValidationError):
            PeerSettings(urls={"node-1": url})
    with pytest.raises(ValidationError):
        PeerSettings(urls={"": "http://10.0.0.2"})


class OneAnswer:
    """A real TCP server that reads one request and answers ``head`` then ``body`` (then holds
    the connection open while ``stall`` is set, or closes it)."""

    def __init__(self, status: int, body: bytes, content_length: int, stall: bool = False) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._answer = (
            f"HTTP/1.1 {status} X\r\nContent-Length: {content_length}\r\n\r\n".encode() + body
        )
        self._stall = threading.Event()
        if stall:
            self._stall.set()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.getsockname()[1]}"

    def _serve(self) -> None:
        connection, _ = self._server.accept()
        with connection:
            request = b""
            while b"\r\n\r\n" not in request:
                request += connection.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += connection.recv(65536)
            connection.sendall(self._answer)
            while self._stall.is_set() and connection.recv(1):
                pass

    def close(self) -> None:
        self._stall.clear()
        self._server.close()


RECORDS = [b"r" * 1000, b"s" * 2000, b"t" * 1000, b"u" * 3000]
WHOLE = b"".join(frame_chunks(RECORDS))


def pull(server: OneAnswer, timeout_s: float = 5.0) -> list[bytearray]:
    try:
        return post_for_frames(server.url, b"{}", {}, timeout_s, len(RECORDS), 4096)
    finally:
        server.close()


def test_a_whole_answer_is_read_record_by_record():
    assert pull(OneAnswer(200, WHOLE, len(WHOLE))) == RECORDS


@pytest.mark.parametrize(
    "cut",
    [
        frames_length(RECORDS[:2]),  # between two frames: whole records, not the whole answer
        frames_length(RECORDS[:2]) + 2,  # inside a frame's length
        frames_length(RECORDS[:2]) + 100,  # inside a record
    ],
)
def test_an_answer_cut_short_is_unavailable_wherever_it_is_cut(cut):
    with pytest.raises(PullFailed) as failed:
        pull(OneAnswer(200, WHOLE[:cut], len(WHOLE)))
    assert failed.value.reason == "unavailable"


def test_a_refusal_is_refused_and_frames_past_the_bounds_are_malformed():
    with pytest.raises(PullFailed) as refused:
        pull(OneAnswer(401, b"{}", 2))
    assert refused.value.reason == "refused"
    oversized = b"".join(frame_chunks([b"x" * 5000]))
    with pytest.raises(PullFailed) as malformed:
        pull(OneAnswer(200, oversized, len(oversized)))
    assert malformed.value.reason == "malformed"


def test_a_peer_that_stops_sending_times_out_at_the_pull_timeout():
    with pytest.raises(PullFailed) as failed:
        pull(OneAnswer(200, WHOLE[:10], len(WHOLE), stall=True), timeout_s=0.5)
    assert failed.value.reason == "timeout"
