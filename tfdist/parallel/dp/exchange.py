"""The islands' exchange (DiLoCo's outer step): a TCP service outside TensorFlow, so that an
island that dies stops no other (a TF or Gloo collective would abort every member).

`tfdist launch --islands=N` runs one `Exchange` in its own process (it outlives the islands'
groups, which it restarts one by one) and gives its address to every worker
(`TFDIST_EXCHANGE`). Every `sync_every` updates each island's chief sends its pseudo-gradient
(the weights at the last sync less its weights now, quantized: `encode`), and every worker of
every island waits for the round's answer: the mean over the islands that sent, quantized again,
which every worker and the exchange apply alike with the outer optimizer (`outer_step`: SGD
with Nesterov momentum, DiLoCo's). So every party holds the same outer weights and momentum, bit
for bit, and the exchange can hand them to an island that comes back (`hello`).

A round closes once every live island's chief has sent (every island is live from the start, and
again from its chief's hello, until its connection closes), or `timeout` seconds after its first
delta: an island cut off without a word, or late to start, is left out of that round, and finds
itself behind at its next sync.

Messages (`tfdist.runtime.wire`): `hello` {island, chief, round, settings, size} ->
{status: ok | behind, round} (+ behind: the current outer weights and momentum), or to a chief
whose state is newer than the exchange's (a new exchange) {status: state}, and it says hello
again with its outer weights and momentum (float32); `sync` {island, chief, round} (+ the
chief's encoded delta) -> {status: ok, round} + the encoded mean, or {status: behind, round} +
weights and momentum.
Each island's workers get the same answer for a round: it is kept per round (and per island,
for an island behind).

Example (a one-island exchange in this process: the mean is the island's own delta):

    >>> import numpy as np
    >>> from tfdist.parallel.dp import exchange
    >>> server = exchange.serve_in_thread("127.0.0.1", islands=1)
    >>> settings = {"outer_lr": 1.0, "outer_momentum": 0.0, "exchange": "float32"}
    >>> c = exchange.Client(server.address, island=0, chief=True, timeout=10)
    >>> c.hello(0, settings, np.zeros(2, np.float32), np.zeros(2, np.float32))[0]
    'ok'
    >>> status, got = c.sync(0, np.array([0.5, -1.0], np.float32))
    >>> status, got.tolist()
    ('ok', [0.5, -1.0])
    >>> c.close(); server.shutdown()
"""
import socket
import socketserver
import threading
import time

import numpy as np

from tfdist.runtime import wire

EXCHANGES = ("float32", "bf16", "int8")
BLOCK = 4096  # int8: elements per scale
CONNECT_TIMEOUT = 10.0


class ExchangeError(Exception):
    """The exchange could not be reached, closed, or did not answer in time."""


# -- the bytes of a delta -------------------------------------------------------------------------
def encode(x, how):
    """[bytes] of float32 vector `x` as `how` sends it: float32; bf16 (rounded to nearest
    even); int8 (per block of BLOCK elements a float32 scale, max |x| / 127, and the rounded
    quotients)."""
    x = np.ascontiguousarray(x, np.float32)
    if how == "float32":
        return [x.tobytes()]
    if how == "bf16":
        bits = x.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # (round to nearest even)
        return [rounded.astype(np.uint16).tobytes()]
    blocks = -(-x.size // BLOCK)
    padded = np.zeros(blocks * BLOCK, np.float32)
    padded[:x.size] = x
    padded = padded.reshape(blocks, BLOCK)
    scales = (np.abs(padded).max(axis=1) / 127).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(padded / safe[:, None]), -127, 127).astype(np.int8)
    return [scales.tobytes(), q.tobytes()]


def encoded_size(n, how):
    """Bytes `encode` gives for `n` elements."""
    if how == "float32":
        return 4 * n
    if how == "bf16":
        return 2 * n
    blocks = -(-n // BLOCK)
    return 4 * blocks + blocks * BLOCK


def decode(data, n, how):
    """The float32 vector of `n` elements that `encode`'s bytes `data` stand for."""
    if how == "float32":
        return np.frombuffer(data, np.float32, n).copy()
    if how == "bf16":
        return (np.frombuffer(data, np.uint16, n).astype(np.uint32) << 16).view(np.float32)
    blocks = -(-n // BLOCK)
    scales = np.frombuffer(data, np.float32, blocks)
    q = np.frombuffer(data, np.int8, blocks * BLOCK, offset=4 * blocks).reshape(blocks, BLOCK)
    return (q.astype(np.float32) * scales[:, None]).reshape(-1)[:n]


def outer_step(theta, momentum, delta, lr, mu):
    """DiLoCo's outer optimizer on the mean pseudo-gradient `delta`: SGD with Nesterov momentum
    `mu` (PyTorch's: m = mu m + d; theta -= lr (d + mu m)). In place; float32 throughout, so
    every party computes the same bits."""
    lr, mu = np.float32(lr), np.float32(mu)
    if mu:
        momentum *= mu
        momentum += delta
        theta -= lr * (delta + mu * momentum)
    else:
        theta -= lr * delta


# -- the service ----------------------------------------------------------------------------------
class Rounds:
    """The exchange's state: the outer weights and momentum, the round, the live islands, the
    deltas of the open round, and each (island, round)'s answer."""

    def __init__(self, islands, timeout):
        self.islands, self.timeout = islands, timeout
        self.cond = threading.Condition()
        self.round = 0
        self.theta = self.momentum = None
        self.settings = None
        self.live = set(range(islands))  # (at the start every island is waited for)
        self.deltas = {}  # island -> float32 delta of the open round
        self.first = None  # when the open round's first delta came
        self.closed = {}  # round -> the answer of every island's workers (the last two)
        self.answers = {}  # (island, "hello" or "behind", round) -> its workers' answer
        self.log = []  # (round, islands that sent), closed rounds

    def hello(self, h, payload):
        with self.cond:
            if self.settings is None:
                self.settings = h["settings"]
                self.timeout = float(self.settings.get("sync_timeout", self.timeout))
            elif h["settings"] != self.settings:
                return {"error": f"island {h['island']}'s settings {h['settings']} differ from "
                                 f"the others' {self.settings}"}, []
            newer = self.theta is None or h["round"] > self.round
            if h["chief"] and newer and not payload:
                return {"status": "state"}, []  # (asked only when needed: it is the model's size)
            if h["chief"] and newer:
                n = h["size"]
                self.theta = np.frombuffer(payload, np.float32, n).copy()
                self.momentum = np.frombuffer(payload, np.float32, n, offset=4 * n).copy()
                self.round = h["round"]
            if h["chief"]:
                self.live.add(h["island"])
            key = (h["island"], "hello", h["round"])
            if key not in self.answers:
                ok = self.cond.wait_for(lambda: self.theta is not None, self.timeout)
                if not ok:
                    return {"error": "no island's chief has said hello"}, []
                self.answers[key] = self._answer_now(h["round"])
            return self.answers[key]

    def _answer_now(self, their_round):
        if their_round == self.round:
            return {"status": "ok", "round": self.round}, []
        return ({"status": "behind", "round": self.round},
                [self.theta.tobytes(), self.momentum.tobytes()])

    def sync(self, h, payload):
        island, r = h["island"], h["round"]
        with self.cond:
            if r < self.round - 1 or (r == self.round - 1 and r not in self.closed):
                # more than a round behind (rounds closed without it): the state of now, the
                # same for each of the island's workers
                key = (island, "behind", r)
                if key not in self.answers:
                    self.answers[key] = self._answer_now(r)
                return self.answers[key]
            if r == self.round and h["chief"]:
                self.live.add(island)
                self.deltas[island] = decode(payload, self.theta.size, self.settings["exchange"])
                self.first = self.first or time.monotonic()
                self._maybe_close()
            limit = 2 * self.timeout + 60
            deadline = time.monotonic() + limit
            while r not in self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"error": f"round {r} did not close within {limit:.0f} s"}, []
                self.cond.wait(min(left, 1.0))
                self._maybe_close()
            return self.closed[r]

    def leave(self, island):
        """An island's chief closed its connection: it is not waited for any more, and its
        answers are forgotten (a restarted group asks again)."""
        with self.cond:
            self.live.discard(island)
            for key in [k for k in self.answers if k[0] == island]:
                del self.answers[key]
            self._maybe_close()
            self.cond.notify_all()

    def _maybe_close(self):
        """Closes the open round once every live island has sent (or its time is up)."""
        if not self.deltas:
            return
        late = time.monotonic() - self.first > self.timeout
        if not (self.live <= set(self.deltas) or late):
            return
        how = self.settings["exchange"]
        order = sorted(self.deltas)
        mean = np.zeros_like(self.theta)
        for k in order:
            mean += self.deltas[k]
        mean /= np.float32(len(order))
        data = encode(mean, how)
        outer_step(self.theta, self.momentum, decode(b"".join(data), mean.size, how),
                   self.settings["outer_lr"], self.settings["outer_momentum"])
        self.closed[self.round] = ({"status": "ok", "round": self.round + 1, "islands": order},
                                   data)
        self.closed.pop(self.round - 2, None)  # (the round before the last: nobody asks for it)
        self.log.append((self.round, order))
        self.round += 1
        self.deltas, self.first = {}, None
        self.cond.notify_all()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        rounds, island, chief = self.server.rounds, None, False
        try:
            while True:
                h = wire.recv(self.request)
                payload = wire.recv_exact(self.request, h.get("bytes", 0))
                island, chief = h["island"], h["chief"]
                if h["op"] == "hello":
                    answer, data = rounds.hello(h, payload)
                elif h["op"] == "sync":
                    answer, data = rounds.sync(h, payload)
                else:
                    answer, data = {"error": f"unknown op {h['op']!r}"}, []
                wire.send(self.request, {**answer, "bytes": sum(len(d) for d in data)}, data)
        except (OSError, ValueError, KeyError):
            pass
        finally:
            if chief:
                rounds.leave(island)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve_in_thread(host, islands, port=0, timeout=120.0):
    """An exchange for `islands` islands on `host`:`port` (0: a free one), served by threads of
    this process; `.address` ("host:port"), `.rounds` (its state), `.shutdown()`. `timeout`:
    seconds a round waits for a missing island, until the islands' settings say
    (`sync_timeout`)."""
    server = _Server((host, port), _Handler)
    server.rounds = Rounds(islands, timeout)
    server.address = f"{host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True, name="tfdist-exchange").start()
    return server


# -- a worker's side ------------------------------------------------------------------------------
class Client:
    """One worker's connection to the exchange at `address` ("host:port"), as worker of island
    `island` (`chief`: the one that sends the island's delta). Every call waits at most
    `timeout` seconds (`ExchangeError` after)."""

    def __init__(self, address, island, chief, timeout):
        self.address, self.island, self.chief, self.timeout = address, island, chief, timeout
        self.settings = None
        self.size = 0
        host, _, port = address.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
        except OSError as e:
            raise ExchangeError(f"the islands' exchange at {address} is unreachable ({e})") \
                from None

    def _call(self, header, payload=()):
        try:
            self.sock.settimeout(self.timeout)
            wire.send(self.sock, {**header, "island": self.island, "chief": self.chief,
                                  "bytes": sum(len(p) for p in payload)}, payload)
            reply = wire.recv(self.sock)
            data = wire.recv_exact(self.sock, reply.get("bytes", 0))
        except (OSError, ValueError) as e:
            raise ExchangeError(f"the islands' exchange at {self.address}: {e}") from None
        if "error" in reply:
            raise ExchangeError(f"the islands' exchange at {self.address}: {reply['error']}")
        return reply, data

    def _state(self, data):
        n = self.size
        return (np.frombuffer(data, np.float32, n).copy(),
                np.frombuffer(data, np.float32, n, offset=4 * n).copy())

    def hello(self, round_, settings, theta, momentum):
        """Joins at `round_` with this island's outer state (the chief's, sent when the exchange
        asks). Returns ("ok", round) or ("behind", round, theta, momentum): the exchange's newer
        state."""
        self.settings, self.size = settings, theta.size
        header = {"op": "hello", "round": round_, "settings": settings, "size": theta.size}
        reply, data = self._call(header)
        if reply["status"] == "state":  # (the exchange has none this new: the chief's)
            reply, data = self._call(header, [theta.tobytes(), momentum.tobytes()])
        if reply["status"] == "ok":
            return "ok", reply["round"]
        return ("behind", reply["round"], *self._state(data))

    def sync(self, round_, delta):
        """Sends this island's `delta` of round `round_` (the chief's; the others send none) and
        waits for the round's answer: ("ok", the decoded mean delta) or ("behind", (round,
        theta, momentum))."""
        how = self.settings["exchange"]
        reply, data = self._call({"op": "sync", "round": round_},
                                 encode(delta, how) if self.chief else [])
        if reply["status"] == "ok":
            return "ok", decode(data, self.size, how)
        return "behind", (reply["round"], *self._state(data))

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
