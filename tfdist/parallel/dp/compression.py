"""Compression of the gradients' all-reduce, with error feedback (`config.dp.compression`).

Each worker sends less than its gradient, and keeps what it did not send (its error) to add to
the next update's gradient, so nothing is lost, only delayed (Seide et al. 2014; Karimireddy et
al. 2019). Two ways:

    bf16      each gradient rounded to bfloat16: half the bytes. The sum goes as an all-to-all
              of the bf16 pieces, summed in float32 by the piece's owner, then an all-gather of
              the bf16 sums (a reduce-scatter and an all-gather: a bf16 ring's bytes, on every
              strategy: Horovod's Gloo has no bf16 all-reduce). The error is each worker's
              rounding; the sum's own rounding to bf16 is not fed back (PyTorch's
              `bf16_compress_hook` feeds back neither).
    powersgd  PowerSGD (Vogels et al. 2019; PyTorch's `powerSGD_hook`): a matrix M (the
              gradient plus the error, viewed as [rows, rest]) goes as P = M Q and Q' = M^T P̂
              (P̂: the summed P, orthonormalised), two all-reduces of (rows + rest) x r floats
              instead of rows x rest. The sum is P̂ Q'^T; each worker's error is its M less a
              worker's share of it. Q is kept from update to update (the warm start), and the
              first `powersgd_start` updates take the plain all-reduce (their error stays zero).

Vectors (biases, norms' scales) and small matrices go uncompressed, as PyTorch's hook does:
PowerSGD compresses a matrix only where it sends under half (`min_compression_rate` 2).

Every worker computes the same sum, so the workers' weights stay equal bit for bit. The state
(each worker's errors, PowerSGD's Q and the count of updates) is this worker's own: backups keep
it per worker (`tfdist.parallel.zero.shards`, kind "dp"), so a resumed run continues exactly.

Example (one worker: the sum is its own gradient, rounded; the rounding is its error):

    >>> import tensorflow as tf
    >>> from tfdist.parallel.dp import collectives, compression
    >>> w = tf.Variable(tf.zeros([2, 2]), name="w")
    >>> bf16 = compression.Compression("bf16")
    >>> g = tf.constant([[1.0, 2.0], [3.0, 1.001]])
    >>> out, = bf16.sum_tensors([g], [w], collectives.local(), "b")
    >>> out.numpy()[1].tolist(), bool(bf16.state["tfdist_dp/error/w"].numpy()[1, 1] != 0)
    ([3.0, 1.0], True)
"""
import contextlib
import zlib

from tfdist.parallel.dp import hierarchy
from tfdist.runtime.lazy import keras, tf

KINDS = ("none", "bf16", "powersgd")
#: PowerSGD compresses a matrix whose elements are at least this many times what it sends.
MIN_COMPRESSION_RATE = 2.0  # (PyTorch's PowerSGDState.min_compression_rate)
#: The names of the state's variables (in backups: tfdist.callbacks.backup).
PREFIX = "tfdist_dp"


class Compression:
    """The compressed sum of gradients over the workers, and this worker's state for it.

    `kind`: "bf16" or "powersgd"; `rank`, `start`: PowerSGD's r and its warm start (updates of
    plain sums first); `local_variables`: the strategy's scope for a variable of this worker's
    own (`Strategy.local_variables`); `worker` of `workers`: this worker's place. `state`:
    {name: variable}, what a backup keeps; `shared`: the names in it that are the same on every
    worker (all but the errors)."""

    def __init__(self, kind, rank=1, start=10, local_variables=contextlib.nullcontext,
                 worker=0, workers=1):
        if kind not in KINDS[1:]:
            raise ValueError(f"compression {kind!r}: one of {', '.join(KINDS[1:])}")
        self.kind, self.rank, self.start = kind, rank, start
        self.local_variables = local_variables
        self.worker, self.workers = worker, workers  # (the backup's shard of this state)
        self.state = {}
        self._error, self._q = {}, {}  # by the model variable's id
        self.steps = None  # the updates summed so far (PowerSGD's warm start counts them)

    def describe(self):
        """One line for the log: how the sums are compressed."""
        if self.kind == "bf16":
            return ("gradients compressed to bfloat16 with error feedback (matrices; vectors "
                    "plain): an all-to-all and an all-gather of bf16 over every worker")
        return (f"gradients compressed by PowerSGD, rank {self.rank}, with error feedback "
                f"(matrices that send under half; the rest plain), after {self.start} updates "
                f"of plain sums")

    def get_config(self):
        return {"compression": self.kind, "powersgd_rank": self.rank,
                "powersgd_start": self.start}

    # -- which tensors, and their state -----------------------------------------------------------
    def compresses(self, variable):
        """Whether the gradient of `variable` goes compressed: a matrix (2 or more dimensions),
        and for PowerSGD one it sends under 1 / MIN_COMPRESSION_RATE of."""
        shape = [int(d) for d in variable.shape]
        if len(shape) < 2:
            return False
        if self.kind == "bf16":
            return True
        rows, rest = _matrix_shape(shape)
        return rows * rest >= MIN_COMPRESSION_RATE * (rows + rest) * self.rank

    def build(self, variables):
        """This worker's state for the gradients of `variables` (eagerly, whatever the caller's
        context: a traced step builds it on its first trace); a variable seen before keeps its
        own. Returns `state`."""
        new = [v for v in variables if self.compresses(v) and id(v) not in self._error]
        if not new and self.steps is not None:
            return self.state
        with tf.init_scope(), self.local_variables():
            if self.steps is None:
                self.steps = self._variable("steps", tf.zeros([], tf.int64))
            for v in new:
                name = self._unique(_name(v))
                error = self._variable(f"error/{name}", tf.zeros(v.shape, tf.float32))
                q = None
                if self.kind == "powersgd":  # the same start on every worker (seeded by name)
                    rows, rest = _matrix_shape(v.shape)
                    seed = [zlib.crc32(name.encode()) % (1 << 31), 0]
                    q = self._variable(f"q/{name}",
                                       tf.random.stateless_normal([rest, self.rank], seed))
                for key in _identities(v):
                    self._error[key], self._q[key] = error, q
        return self.state

    @property
    def shared(self):
        return [k for k in self.state if not k.startswith(f"{PREFIX}/error/")]

    def _unique(self, name):
        """`name`, or with a suffix where another variable's has it (TF names need not differ)."""
        taken = {k.split("/", 2)[2] for k in self.state if k.startswith(f"{PREFIX}/error/")}
        out, k = name, 1
        while out in taken:
            out, k = f"{name}_{k}", k + 1
        return out

    def _variable(self, name, initial):
        variable = tf.Variable(initial, trainable=False, name=f"{PREFIX}_{name.split('/')[0]}")
        self.state[f"{PREFIX}/{name}"] = variable
        return variable

    def count(self):
        """Counts one update's sums done (after every bucket's: the graph orders them)."""
        return self.steps.assign_add(1)

    # -- the sum ----------------------------------------------------------------------------------
    def sum_tensors(self, tensors, variables, c, name):
        """`tensors` (the gradients of `variables`) each summed over every worker of `c`
        (`Collectives`, group "all"), the matrices compressed; at each tensor's shape and dtype.
        """
        self.build(variables)
        picked = [k for k, v in enumerate(variables) if id(v) in self._error]
        plain = [k for k in range(len(tensors)) if k not in picked]
        out = [None] * len(tensors)
        if plain:
            summed = _sum_plain([tensors[k] for k in plain], c, f"{name}/plain")
            for k, s in zip(plain, summed):
                out[k] = s
        if picked:
            grads = [tf.cast(tensors[k], tf.float32) for k in picked]
            own = [variables[k] for k in picked]
            if self.kind == "bf16":
                summed = self._bf16(grads, own, c, name)
            else:  # the first `start` updates: the plain sum, and no error kept
                summed = tf.cond(self.steps < self.start,
                                 lambda: _sum_plain(grads, c, f"{name}/warm"),
                                 lambda: self._powersgd(grads, own, c, name))
                summed = summed if isinstance(summed, list) else [summed]
            for k, s in zip(picked, summed):
                out[k] = tf.cast(s, tensors[k].dtype)
        return out

    def _bf16(self, grads, variables, c, name):
        errors = [self._error[id(v)] for v in variables]
        full = [g + e for g, e in zip(grads, errors)]
        flat = tf.concat([tf.reshape(x, [-1]) for x in full], 0)
        rounded = tf.cast(flat, tf.bfloat16)
        kept = flat - tf.cast(rounded, tf.float32)
        sizes = [x.shape.num_elements() for x in full]
        updates = [e.assign(tf.reshape(part, e.shape))
                   for e, part in zip(errors, tf.split(kept, sizes))]
        with tf.control_dependencies(updates):
            total = sum_bf16(rounded, c, name)
        return [tf.reshape(part, g.shape) for part, g in zip(tf.split(total, sizes), grads)]

    def _powersgd(self, grads, variables, c, name):
        n = float(len(c.hosts.of_worker))
        errors = [self._error[id(v)] for v in variables]
        qs = [self._q[id(v)] for v in variables]
        ms = [tf.reshape(g + e, _matrix_shape(g.shape)) for g, e in zip(grads, errors)]
        ps = _sum_plain([m @ q for m, q in zip(ms, qs)], c, f"{name}/p")
        ps = [tf.linalg.qr(p)[0] for p in ps]  # (the same on every worker: the same input)
        new_qs = _sum_plain([tf.transpose(m) @ p for m, p in zip(ms, ps)], c,
                                   f"{name}/q")
        out, updates = [], []
        for g, m, p, q, e, q_var in zip(grads, ms, ps, new_qs, errors, qs):
            approx = p @ tf.transpose(q)  # the sum's approximation
            updates.append(e.assign(tf.reshape(m - approx / n, e.shape)))
            updates.append(q_var.assign(q))
            out.append(tf.reshape(approx, g.shape))
        with tf.control_dependencies(updates):
            return [tf.identity(x) for x in out]


def attach(optimizer, compressor):
    """Makes `compressor` the one whose state a backup of `optimizer`'s model keeps (`of`)."""
    optimizer.tfdist_dp_compression = compressor


def of(optimizer):
    """The `Compression` of the strategy that reduces `optimizer`'s gradients, or None."""
    return getattr(optimizer, "tfdist_dp_compression", None)


def sum_bf16(rounded, c, name):
    """`rounded` (1-D bfloat16, this worker's) summed over the workers of `c`: each worker's
    1 / G piece goes to its owner (an all-to-all), which sums the G pieces in float32 and rounds
    the sum to bf16, then every owner's piece to every worker (an all-gather). The bf16 values
    travel as int32 pairs (no collective here needs a bf16 kernel). Returns float32, `rounded`'s
    length."""
    g = len(c.hosts.of_worker)
    n = int(rounded.shape[0])
    width = -(-n // (2 * g)) * 2  # each piece's length, even (two bf16 to an int32)
    rows = tf.reshape(tf.pad(rounded, [[0, g * width - n]]), [g, width // 2, 2])
    received = c.all_to_all(tf.bitcast(rows, tf.int32), "all", f"{name}/scatter")
    pieces = tf.reshape(tf.bitcast(received, tf.bfloat16), [g, width])
    mine = tf.cast(tf.reduce_sum(tf.cast(pieces, tf.float32), 0), tf.bfloat16)
    gathered = c.all_gather(tf.bitcast(tf.reshape(mine, [-1, 2]), tf.int32), "all",
                            f"{name}/gather")
    return tf.cast(tf.reshape(tf.bitcast(gathered, tf.bfloat16), [-1])[:n], tf.float32)


def _sum_plain(tensors, c, name):
    """`tensors` summed over every worker (one all-reduce of their concatenation, float32)."""
    return hierarchy.concatenated(tensors, lambda flat: c.all_reduce(flat, "all", name))


def _matrix_shape(shape):
    """A gradient's shape viewed as a matrix: [its first dimension, the rest] (PyTorch's)."""
    shape = [int(d) for d in shape]
    rest = 1
    for d in shape[1:]:
        rest *= d
    return [shape[0], rest]


def _name(variable):
    """A variable's name in the state: its Keras path (unique in a model), else its TF name."""
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def _identities(variable):
    """The ids a model variable's gradient may come paired with: the Keras variable's, and its
    TF variable's (what Keras's optimizer hands its all-reduce, `.value` outside a layer's
    call)."""
    if isinstance(variable, keras.Variable):
        return {id(variable), id(variable.value)}
    return {id(variable)}
