"""The wire of tfdist's own TCP services (the keepers: `tfdist.runtime.keeper`; the islands'
exchange: `tfdist.parallel.dp.exchange`): each message a 4-byte length, a JSON header, then the
raw bytes the header counts.

Example (a message through a socket pair):

    >>> import socket
    >>> from tfdist.runtime import wire
    >>> a, b = socket.socketpair()
    >>> wire.send(a, {"op": "hello", "bytes": 3}, [b"abc"])
    >>> header = wire.recv(b); header, wire.recv_exact(b, header["bytes"])
    ({'op': 'hello', 'bytes': 3}, b'abc')
    >>> a.close(); b.close()
"""
import json
import struct

_HEADER = struct.Struct("!I")


class Closed(ConnectionError):
    """The other end closed the connection."""


def recv_exact(sock, n):
    """`n` bytes from `sock` (`Closed` if it closes first)."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise Closed("the connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send(sock, header, payload=()):
    """Sends `header` (JSON) and then each bytes-like of `payload`."""
    data = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)
    for part in payload:
        sock.sendall(part)


def recv(sock):
    """The next message's header (its payload follows: `recv_exact`)."""
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    return json.loads(recv_exact(sock, n))
