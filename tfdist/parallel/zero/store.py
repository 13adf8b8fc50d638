"""Where ZeRO-Offload keeps what it moves off the device: host memory, or files on a local disk.

A `Store` holds named arrays (a replica's optimizer slots, and under ZeRO-3 its master weights;
`tfdist.parallel.zero.offload` names them). `put` and `get` copy whole arrays; `prefetch` starts
reads in the background and `write_behind` starts writes, so that the optimizer's step over one
sub-group overlaps the reading of the next and the writing of the one before (DeepSpeed's
`pipeline_read` / `pipeline_write`). The caller bounds what is in flight (`wait` for the writes
it started); `threads` reads and writes run at once (the disk's queue depth).

    kind "host"   numpy arrays in this process's memory (on a GPU host: off the device)
    kind "disk"   one file per array under `directory`, written and read with O_DIRECT where the
                  file system allows it (the page cache is then not filled), else buffered

The store starts empty (a directory left by a killed run is emptied: the run's state comes from
its backup) and `close()` removes its files. Counters: `bytes_read`, `bytes_written`.

Example:

    >>> import numpy as np, tempfile
    >>> from tfdist.parallel.zero.store import Store
    >>> store = Store("disk", tempfile.mkdtemp())
    >>> store.put("m/w", np.arange(3, dtype="float32"))
    >>> store.prefetch(["m/w"])
    >>> store.get("m/w").tolist(), store.bytes_written
    ([0.0, 1.0, 2.0], 12)
    >>> store.close()
"""
import concurrent.futures
import contextlib
import errno
import mmap
import os
import shutil
import threading

import numpy as np

from tfdist.errors import UsageError

_BLOCK = 4096  # O_DIRECT's alignment of offsets, sizes and buffers


class StoreError(UsageError):
    """A store that cannot be written (a full disk, a lost directory): one line."""


class Store:
    """Arrays of `kind` ("host" or "disk": files under `directory`), `threads` reads and writes
    at once (`prefetch=False`: none in the background; every read and write waits)."""

    def __init__(self, kind, directory=None, threads=4, prefetch=True):
        if kind not in ("host", "disk"):
            raise ValueError(f"a store is 'host' or 'disk', not {kind!r}")
        self.kind, self.directory = kind, directory
        self.overlap = prefetch
        self.bytes_read = self.bytes_written = 0
        self._arrays = {}  # host: name -> array
        self._meta = {}  # name -> (shape, dtype)
        self._reads = {}  # name -> future of its array
        self._writes = {}  # name -> future of its write
        self._lock = threading.Lock()
        self._direct = True
        self.failure = None  # the StoreError of a write that failed
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "tfdist-offload")
        self._mark = _prepare(directory) if kind == "disk" else None  # (held: the store's lock)

    # -- what the offloaded step calls ---------------------------------------------------------
    def put(self, name, array):
        """Stores a copy of `array` under `name` (waits for the write)."""
        self.write_behind(name, array)
        self._wait_write(name)

    def write_behind(self, name, array):
        """Starts storing `array` (kept as it is: not changed by the caller after) under
        `name`."""
        array = np.asarray(array)
        self._wait_write(name)
        with self._lock:  # (a read ahead of the old value: done, then forgotten)
            stale = self._reads.pop(name, None)
        if stale is not None:
            stale.exception()
        with self._lock:
            self._meta[name] = (array.shape, array.dtype)
        if self.kind == "host":
            self._arrays[name] = np.array(array, copy=True)
            self.bytes_written += array.nbytes
            return
        future = self._pool.submit(self._write_file, name, array)
        with self._lock:
            self._writes[name] = future
        if not self.overlap:
            self._wait_write(name)

    def prefetch(self, names):
        """Starts reading `names` in the background (nothing when prefetch is off)."""
        if self.kind == "host" or not self.overlap:
            return
        with self._lock:
            for name in names:
                if name not in self._reads:
                    self._reads[name] = self._pool.submit(self._read_after_write, name)

    def get(self, name):
        """The array stored under `name` (a prefetched one, or read now)."""
        if self.kind == "host":
            self._check(name)
            self.bytes_read += self._arrays[name].nbytes
            return self._arrays[name]
        with self._lock:
            future = self._reads.pop(name, None)
        if future is not None:
            return future.result()
        return self._read_after_write(name)

    def drop_prefetched(self, keep=()):
        """Forgets the reads in flight but those of `keep` (what they read is about to change,
        or will not be asked for); their errors too (a read asked for again raises its own)."""
        with self._lock:
            reads = [f for name, f in self._reads.items() if name not in keep]
            self._reads = {name: f for name, f in self._reads.items() if name in keep}
        for future in reads:
            future.exception()

    def wait(self, names):
        """Returns once the writes of `names` are done (StoreError when one failed)."""
        for name in names:
            self._wait_write(name)

    def flush(self):
        """Returns once every write is done."""
        self.wait(list(self._writes))

    def names(self):
        return list(self._meta)

    def shape(self, name):
        return self._meta[name][0]

    def dtype(self, name):
        return self._meta[name][1]

    def nbytes_of(self, name):
        shape, dtype = self._meta[name]
        return int(np.prod(shape)) * np.dtype(dtype).itemsize

    @property
    def nbytes(self):
        """Bytes stored."""
        return sum(self.nbytes_of(name) for name in self._meta)

    def close(self):
        """Waits for the writes, removes the files (disk), drops the arrays."""
        try:
            self.drop_prefetched()
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
            self._arrays.clear()
            if self.kind == "disk":
                if self._mark is not None:
                    self._mark.close()  # (its lock)
                _remove(self.directory)

    # -- files ---------------------------------------------------------------------------------
    def _check(self, name):
        if name not in self._meta:
            raise KeyError(f"the offload store holds no {name!r}")

    def _path(self, name):
        return os.path.join(self.directory, name.replace("/", "~") + ".bin")

    def _wait_write(self, name):
        with self._lock:
            future = self._writes.pop(name, None)
        if future is not None:
            future.result()

    def _read_after_write(self, name):
        self._check(name)
        with self._lock:  # (waited for, not taken: its writer still sees how it ended)
            write = self._writes.get(name)
        if write is not None:
            write.result()
        shape, dtype = self._meta[name]
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        try:
            buffer = mmap.mmap(-1, max(_BLOCK, _padded(size)))  # (page-aligned: O_DIRECT's)
            fd = self._open(name, os.O_RDONLY)
            try:
                got = os.preadv(fd, [buffer], 0)
            finally:
                os.close(fd)
        except OSError as e:
            self.failure = StoreError(
                f"could not read the offloaded {name} from {self.directory} "
                f"({os.strerror(e.errno) if e.errno else e}); the offload directory must stay as "
                f"the run left it: run the same command to resume from the newest backup")
            raise self.failure from None
        if got < size:
            self.failure = StoreError(
                f"offload file {self._path(name)} is short ({got} of {size} bytes); the offload "
                f"directory was changed during the run: run the same command to resume from the "
                f"newest backup")
            raise self.failure
        with self._lock:
            self.bytes_read += size
        return np.frombuffer(buffer, dtype, int(np.prod(shape))).reshape(shape)

    def _write_file(self, name, array):
        size = array.nbytes
        buffer = None
        try:
            buffer = mmap.mmap(-1, max(_BLOCK, _padded(size)))
            np.frombuffer(buffer, np.uint8, size)[:] = \
                np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            fd = self._open(name, os.O_WRONLY | os.O_CREAT)
            try:
                written = os.pwritev(fd, [buffer], 0)
            finally:
                os.close(fd)
            if written < len(buffer):  # (a full disk may write part of it)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self.failure = StoreError(
                f"could not write the offloaded {name} to {self.directory} "
                f"({os.strerror(e.errno) if e.errno else e}); free space there or choose "
                f"another zero.offload_dir, then run the same command to resume from the "
                f"newest backup")
            raise self.failure from None
        finally:
            if buffer is not None:
                buffer.close()
        with self._lock:
            self.bytes_written += size

    def _open(self, name, flags):
        path = self._path(name)
        if self._direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:  # (EINVAL: this file system has no O_DIRECT)
                    raise
                self._direct = False
        return os.open(path, flags, 0o600)


def _padded(size):
    return -(-size // _BLOCK) * _BLOCK


_MARK = ".tfdist-offload"  # the file that makes a directory a store's (which it may empty)


def _remove(directory):
    """Removes a store's directory, its marker last: a process killed while removing it leaves
    a directory the next run still recognises as a store's (and empties)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name != _MARK:
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    shutil.rmtree(directory, ignore_errors=True)


def _prepare(directory):
    """`directory` made, or emptied when a killed run's store left it (its state comes from
    the backup), and writable; a one-line UsageError otherwise. Returns the open marker file,
    whose lock (flock) says a live store uses the directory: a second store is refused."""
    import fcntl
    if not directory:
        raise UsageError("zero.offload=disk needs a directory: set --config.zero.offload_dir")
    mark = os.path.join(directory, _MARK)
    if os.path.isdir(directory) and os.listdir(directory):
        if not os.path.exists(mark):
            raise UsageError(f"{directory} holds files that are not an offload store's; give "
                             f"zero.offload_dir a directory of its own (nothing was deleted)")
        with open(mark, "rb") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise UsageError(f"the offload store {directory} is in use by another run; give "
                                 f"each run a zero.offload_dir of its own") from None
        _remove(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        f = open(mark, "wb")
        f.write(b"tfdist offload store: removed at the end of the run\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return f
    except OSError as e:
        raise UsageError(f"zero.offload_dir {directory} cannot be written "
                         f"({os.strerror(e.errno) if e.errno else e}); give a writable "
                         f"directory on a local disk") from None
