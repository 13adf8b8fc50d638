"""A host's keeper: the newest in-memory snapshots of the training state, in a process of its own.

`tfdist launch` starts one keeper on each host it uses (its warm agent forks it before importing
TensorFlow: `tfdist/launch/agent.py`). Every training process sends its snapshot of each step
to its own host's keeper, and, when its state is a shard that no other replica holds (ZeRO), a
copy to the keeper of a peer on another host (Gemini, SOSP 2023). The keeper outlives the
training processes of its host, which a failed group's restart stops, and dies with its host:
a replacement takes the state from a surviving keeper's memory, not from disk
(`tfdist.callbacks.memory`).

A snapshot is `(owner, step)`: the rank whose state it is, and the step it was taken after; its
`meta` (JSON: the group's size, whether it is a shard) and its files (name -> bytes: the backup
files of that rank, as `tfdist.callbacks.BackupAndRestore` writes them). Per owner the keeper
keeps the newest `KEEP` snapshots, and the newest whose step is a multiple of its `anchor` (the
peer copies' interval), so that a full set at one step outlives the newer local ones.

Protocol: TCP; each message is a 4-byte length, a JSON header, then the bytes its header counts.
`put` (after `pending`, which `settle` waits for), `list`, `settle`, `get`, `trim`.

Example (a keeper in this process, for the example; `start` forks one):

    >>> from tfdist.runtime import keeper
    >>> server = keeper.serve_in_thread("127.0.0.1")
    >>> k = keeper.Client(server.address)
    >>> k.put(0, 7, {"size": 1}, {"ckpt-7.index": b"abc"})
    >>> [(h["owner"], h["step"]) for h in k.list()["held"]]
    [(0, 7)]
    >>> k.get(0, 7)["ckpt-7.index"]
    b'abc'
    >>> k.close(); server.shutdown()
"""
import os
import socket
import socketserver
import sys
import threading
import time

from tfdist.runtime import process, wire

KEEP = 2  # snapshots kept per owner (and its newest at a multiple of its anchor)
CONNECT_TIMEOUT = 3.0  # seconds: a keeper that does not accept by then is lost (its host)


class KeeperError(Exception):
    """A keeper could not be reached, or lost the connection, or lacks what was asked."""


# -- the keeper ----------------------------------------------------------------------------------
class Store:
    """The snapshots, and the pushes announced but not yet complete."""

    def __init__(self):
        self.held = {}  # (owner, step) -> {"meta", "files", "at"}
        self.pending = {}  # connection id -> (owner, step)
        self.changed = threading.Condition()
        self.last = 0.0  # time.monotonic() of the newest push or announcement

    def put(self, owner, step, meta, files):
        with self.changed:
            self.held[owner, step] = {"meta": meta, "files": files, "at": time.time()}
            anchor = int(meta.get("anchor") or 0)
            steps = sorted((s for o, s in self.held if o == owner), reverse=True)
            keep = set(steps[:KEEP])
            keep |= set([s for s in steps if anchor and s % anchor == 0][:1])
            for s in steps:
                if s not in keep:
                    del self.held[owner, s]
            self.last = time.monotonic()
            self.changed.notify_all()

    def listing(self):
        with self.changed:
            return {"held": [{"owner": o, "step": s, "meta": x["meta"],
                              "bytes": sum(len(b) for b in x["files"].values())}
                             for (o, s), x in sorted(self.held.items())],
                    "pending": sorted(self.pending.values())}

    def settle(self, timeout, quiet):
        """The listing once no push is under way and none has come for `quiet` s (`timeout` s
        at most): what a failed group's survivors had sent by then."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while time.monotonic() < deadline:
                wait = self.last + quiet - time.monotonic()
                if not self.pending and wait <= 0:
                    break
                self.changed.wait(min(max(wait, 0.01), deadline - time.monotonic()))
        return self.listing()

    def trim(self, after):
        with self.changed:
            for key in [k for k in self.held if k[1] > after]:
                del self.held[key]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        store, me = self.server.store, id(self)
        try:
            self._serve(store, me)
        except (OSError, KeeperError, ValueError):  # a client gone mid-reply: nothing to say
            pass
        finally:
            with store.changed:
                if store.pending.pop(me, None) is not None:
                    store.changed.notify_all()

    def _serve(self, store, me):
        """Answers this connection's requests until it closes (`wire.recv` raises then: `handle`
        ends quietly)."""
        while True:
            h = wire.recv(self.request)
            op = h.get("op")
            if op == "pending":
                with store.changed:
                    store.pending[me] = (h["owner"], h["step"])
                    store.last = time.monotonic()
                wire.send(self.request, {"ok": True})
            elif op == "put":
                files = {name: wire.recv_exact(self.request, n) for name, n in h["files"]}
                with store.changed:
                    store.pending.pop(me, None)
                store.put(h["owner"], h["step"], h["meta"], files)
                wire.send(self.request, {"ok": True})
            elif op == "list":
                wire.send(self.request, store.listing())
            elif op == "settle":
                wire.send(self.request, store.settle(float(h.get("timeout", 1.0)),
                                                 float(h.get("quiet", 0.0))))
            elif op == "trim":
                store.trim(int(h["after"]))
                wire.send(self.request, {"ok": True})
            elif op == "get":
                self._get(store, h)
            else:
                wire.send(self.request, {"error": f"unknown op {op!r}"})

    def _get(self, store, h):
        with store.changed:
            snap = store.held.get((h["owner"], h["step"]))
        if snap is None:
            wire.send(self.request,
                      {"error": f"no snapshot of rank {h['owner']} at step {h['step']}"})
            return
        names = [n for n in sorted(snap["files"]) if h.get("names") is None or n in h["names"]]
        wire.send(self.request, {"meta": snap["meta"],
                             "files": [[n, len(snap["files"][n])] for n in names]},
              [snap["files"][n] for n in names])


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address):
        super().__init__((address, 0), _Handler)
        self.store = Store()
        self.address = f"{address}:{self.server_address[1]}"


def serve_in_thread(address):
    """A keeper served by a thread of this process (tests, examples); `.shutdown()` ends it."""
    server = _Server(address)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start(address):
    """Forks this host's keeper, listening on `address` (a free port). Returns (pid, "host:port").
    The keeper imports nothing beyond the standard library, and dies with its parent."""
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setsid()
            if not process.die_with_parent(parent):  # (the agent is gone already)
                os._exit(1)
            process.name_self("tfdist-keeper")
            process.set_title(f"tfdist-keeper {address}")
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            server = _Server(address)
            os.write(w, server.address.encode())
            os.close(w)
            server.serve_forever()
            code = 0
        except BaseException as e:  # noqa: BLE001
            print(f"tfdist: keeper at {address}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        where = f.read().decode()
    return pid, where or None


# -- the client ----------------------------------------------------------------------------------
class Client:
    """A connection to the keeper at "host:port", made within CONNECT_TIMEOUT s. Each call then
    waits at most `timeout` s for each reply or part of one."""

    def __init__(self, address, timeout=10.0):
        self.address = address
        self.timeout = timeout
        self._sock = None

    def _connect(self):
        if self._sock is None:
            host, _, port = self.address.rpartition(":")
            try:
                self._sock = socket.create_connection((host, int(port)),
                                                      timeout=min(self.timeout, CONNECT_TIMEOUT))
            except OSError as e:
                raise KeeperError(f"keeper {self.address} unreachable ({e})") from None
        return self._sock

    def _call(self, header, payload=(), timeout=None):
        sock = self._connect()
        try:
            sock.settimeout(timeout or self.timeout)
            wire.send(sock, header, payload)
            reply = wire.recv(sock)
        except (OSError, KeeperError, ValueError) as e:
            self.close()
            raise KeeperError(f"keeper {self.address}: {e}") from None
        if "error" in reply:
            raise KeeperError(f"keeper {self.address}: {reply['error']}")
        return reply

    def pending(self, owner, step):
        self._call({"op": "pending", "owner": owner, "step": step})

    def put(self, owner, step, meta, files):
        names = sorted(files)
        size = sum(len(files[n]) for n in names)
        self._call({"op": "put", "owner": owner, "step": step, "meta": meta,
                    "files": [[n, len(files[n])] for n in names]}, [files[n] for n in names],
                   timeout=self.timeout + size / 2**20 * 0.1)

    def list(self):
        return self._call({"op": "list"})

    def settle(self, timeout, quiet=0.2):
        """What the keeper holds once pushes under way are done and none has come for `quiet`
        s (`timeout` s at most)."""
        return self._call({"op": "settle", "timeout": timeout, "quiet": quiet},
                          timeout=self.timeout + timeout)

    def trim(self, after):
        self._call({"op": "trim", "after": after})

    def get(self, owner, step, names=None):
        """{name: bytes} of the snapshot of `owner` at `step` (only `names`, if given)."""
        return self.fetch(owner, step, names)[0]

    def fetch(self, owner, step, names=None):
        """({name: bytes}, meta) of the snapshot of `owner` at `step` (only `names`, if
        given)."""
        sock = self._connect()
        try:
            sock.settimeout(self.timeout)
            wire.send(sock, {"op": "get", "owner": owner, "step": step, "names": names})
            reply = wire.recv(sock)
            if "error" in reply:
                raise KeeperError(reply["error"])
            return {name: wire.recv_exact(sock, n) for name, n in reply["files"]}, reply["meta"]
        except (OSError, KeeperError, ValueError) as e:
            self.close()
            raise KeeperError(f"keeper {self.address}: {e}") from None

    def close(self):
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
