"""`tpu`: TPUStrategy on a Cloud TPU (a TPU VM's own chips, or a named TPU).

    tfdist train --config=configs/gpt_mini.py --strategy=tpu                      # on a TPU VM
    tfdist train --config=configs/gpt2.py --strategy=tpu --config.strategy.tpu=my-tpu \\
        --config.strategy.tpu_zone=us-central2-b --config.strategy.tpu_project=my-project

`config.strategy.tpu` is `local` (the TPU VM this runs on; the default), a TPU name (with
`tpu_zone` and `tpu_project`, looked up through the Cloud TPU API), or a `grpc://host:port`
address. Finding, connecting to and initialising the TPU system runs under a timeout
(`tpu_timeout`, seconds; initialising a pod can take a minute), and a `grpc://` address must
first accept a TCP connection within 5 s: TF 2.21 waits forever on an address where nothing
listens, and fails at once where no TPU system exists. Either way the run ends with one line.

Recommended for TPUs, applied by `tfdist train` unless the config sets them (`RECOMMENDED`):
`mixed_bfloat16`, and `steps_per_execution` > 1 (several steps per host round trip). Batches have
static shapes, as XLA on TPUs needs: tfdist's pipeline gathers every batch at its fixed size (what
`drop_remainder=True` gives a batched dataset; do that with your own). Every path tfdist reads or
writes goes through `tf.io.gfile`, so backups, logs and TFDS data can be on `gs://`, which TPU
hosts need.

Usage (not run as a doctest: needs a TPU, or a resolver of your own such as a test double):

    import tfdist.strategies
    strategy = tfdist.strategies.get("tpu", resolver=my_resolver)
    with strategy.scope():
        model = ...
"""
import socket
import threading

from tfdist.errors import UsageError
from tfdist.runtime.lazy import tf
from tfdist.strategies.base import Strategy

#: Config values a TPU run should use, applied where the config keeps tfdist's defaults.
RECOMMENDED = {"train.precision": "mixed_bfloat16", "train.steps_per_execution": 32}

_HOW = ("on a Cloud TPU VM (with the tensorflow-tpu package) use --config.strategy.tpu=local; "
        "elsewhere give --config.strategy.tpu=<name> with tpu_zone and tpu_project, or "
        "grpc://<host>:8470")


class NoTPU(UsageError):
    """No TPU was found or reached. The process exits at once: a connection attempt may still
    be waiting inside TensorFlow, and it would hold the exit up."""
    hard_exit = True


def make_resolver(tpu="local", zone="", project=""):
    """The TPUClusterResolver for `config.strategy` (zone and project only for a TPU name)."""
    kwargs = {"tpu": tpu}
    if zone:
        kwargs["zone"] = zone
    if project:
        kwargs["project"] = project
    return tf.distribute.cluster_resolver.TPUClusterResolver(**kwargs)


REACH_TIMEOUT = 5.0  # seconds for a grpc:// address to accept a TCP connection


def check_reachable(address, timeout=REACH_TIMEOUT):
    """A `grpc://host:port` TPU address must accept a TCP connection within `timeout` seconds.
    TF's own connect waits forever on an address where nothing listens."""
    host, _, port = address[len("grpc://"):].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise NoTPU(f"no TPU reachable at {address} ({e.strerror or e} within {timeout:g} s); "
                    f"{_HOW}") from None


def connect(resolver_fn, timeout):
    """Builds the resolver, connects to its cluster and initialises the TPU system, all within
    `timeout` seconds. Returns the resolver; raises `NoTPU` with what went wrong."""
    box = {}

    def attempt():
        try:
            resolver = resolver_fn()
            if resolver.master() or resolver.cluster_spec().as_dict():
                tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
            box["resolver"] = resolver
        except Exception as e:  # TF raises many kinds here; each means "no usable TPU"
            box["error"] = e

    thread = threading.Thread(target=attempt, daemon=True, name="tfdist-tpu-connect")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise NoTPU(f"no TPU reached within {timeout:g} s (config.strategy.tpu_timeout); "
                    f"{_HOW}")
    if "error" in box:
        text = " ".join(str(box["error"]).split()) or type(box["error"]).__name__
        raise NoTPU(f"no TPU found ({text.split('. ')[0][:160]}); {_HOW}")
    return box["resolver"]


class TPU(Strategy):
    name = "tpu"
    supports_jit_compile = True  # XLA is how TPUs run anyway
    supports_pipeline = False  # TPUStrategy replicates the model over the cores; no stages
    recommended = RECOMMENDED
    options = {
        "tpu": ("local", lambda v: bool(v.strip()), "local, a TPU name or grpc://host:port"),
        "tpu_zone": ("", lambda v: isinstance(v, str), "a zone (with a TPU name)"),
        "tpu_project": ("", lambda v: isinstance(v, str), "a project (with a TPU name)"),
        "tpu_timeout": (120.0, lambda v: 0 < v <= 3600, "a number of seconds in (0, 3600]"),
    }

    @classmethod
    def plan_command(cls, device, processes, per_node, flags):
        if device.startswith("tpu"):
            return "tfdist train --strategy=tpu " + " ".join(flags)
        return None

    def __init__(self, tpu="local", tpu_zone="", tpu_project="", tpu_timeout=120.0, resolver=None,
                 **unused_options):
        if resolver is None:
            if tpu.startswith("grpc://"):
                check_reachable(tpu)
            resolver = connect(lambda: make_resolver(tpu or "local", tpu_zone, tpu_project),
                               tpu_timeout)
        self.resolver = resolver
        super().__init__(tf.distribute.TPUStrategy(resolver))

    @property
    def num_workers(self):
        return max(1, self.resolver.get_tpu_system_metadata().num_hosts)

    def describe(self):
        meta = self.resolver.get_tpu_system_metadata()
        return (f"{self.name}: {self.num_replicas} TPU core(s) on {meta.num_hosts} host(s)"
                f"{' at ' + self.resolver.master() if self.resolver.master() else ''}")
