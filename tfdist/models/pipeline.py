"""Layer-split model parallelism with pipelined microbatches (GPipe) for the GPT.

`Pipeline(gpt, stages=K, microbatches=M)` partitions an (unbuilt) `GPT` into K contiguous stages
and places each stage's variables and ops on its device: stage 0 has the embeddings and the first
blocks, stage K-1 the last blocks and the head (the head reads the tied token embedding from
stage 0). The GPT file itself knows nothing of this; the pipeline calls its parts (`embed`,
`blocks`, `head`) under `tf.device`.

The train step splits the batch into M microbatches, runs each through the stages, and takes the
gradient of the mean of their losses, so gradients accumulate over the microbatches and one
optimizer update follows (GPipe's schedule: all forwards, then all backwards). Nothing is
scheduled by hand: the step is one TF graph, and TF's executor runs stage s of microbatch m+1
while stage s+1 works on microbatch m, because the two are independent ops on different
devices. Two facts make that work (both measured on TF 2.21):

* the gradient is taken with `tf.gradients`, which puts each backward op on the device of its
  forward op (`GradientTape` would put all of them on the default device);
* the overlap comes from TF's inter-op thread pool, so it needs at least 2 inter-op threads
  (`train.inter_op_threads`; 0 = TF's default, one per core).

`recompute=True` wraps each stage in `tf.recompute_grad`: its activations are not kept for the
backward pass but computed again, trading compute for memory.

Example (2 logical CPU devices, 4 microbatches):

    >>> import tensorflow as tf
    >>> from tfdist.models.gpt import GPT
    >>> from tfdist.models.pipeline import Pipeline
    >>> from tfdist.parallel.layout import configure_logical_cpus
    >>> configure_logical_cpus(2)
    >>> model = Pipeline(GPT(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32),
    ...                  stages=2, microbatches=4)
    >>> model.build()
    >>> print(model.describe())  # doctest: +NORMALIZE_WHITESPACE
    pipeline of 2 stages, 4 microbatch(es): stage 0: embed + blocks 0-1 on /device:CPU:0;
    stage 1: blocks 2-3 + head on /device:CPU:1
    >>> tuple(model(tf.zeros((8, 32), tf.int32)).shape)
    (8, 32, 256)
"""
import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfdist import compat
from tfdist.models import arithmetic
from tfdist.models import tensor_parallel as tp
from tfdist.models.gpt import GPT


def block_costs(gpt):
    """Relative forward FLOPs per token of each block, and of the embedding and the head
    (tfdist.models.arithmetic: a block's matmuls, 2 * 12 C^2, and attention's 4 T C)."""
    a = gpt.arch_sizes
    return [a.layer_flops()] * gpt.n_layer, a.embedding_flops(), a.head_flops()


def balanced_split(costs, stages, first_extra=0.0, last_extra=0.0):
    """Block counts of `stages` contiguous, non-empty groups minimising the costliest stage
    (the first stage also carries `first_extra`, the last `last_extra`)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = {}

    def cost(i, j, s):
        """Blocks i..j-1 as stage s."""
        return (prefix[j] - prefix[i] + (first_extra if s == 0 else 0)
                + (last_extra if s == stages - 1 else 0))

    def solve(i, s):
        """(max cost, counts) for blocks i.. as stages s.."""
        if s == stages - 1:
            return cost(i, n, s), [n - i]
        if (i, s) not in best:
            options = []
            for j in range(i + 1, n - (stages - s - 1) + 1):
                rest, counts = solve(j, s + 1)
                options.append((max(cost(i, j, s), rest), [j - i] + counts))
            best[i, s] = min(options, key=lambda o: o[0])
        return best[i, s]

    return solve(0, 0)[1]


def default_devices(n):
    """The first `n` devices of this process: its GPUs if it has enough, else its (logical)
    CPUs. (`tfdist.parallel.layout.Layout.split_cpu` and `place_devices` judge and place a run's
    devices.)"""
    for kind in ("GPU", "CPU"):
        found = tf.config.list_logical_devices(kind)
        if len(found) >= n:
            return [d.name for d in found[:n]]
    raise ValueError(f"{n} devices wanted; split the CPU first "
                     f"(tfdist.parallel.layout.configure_logical_cpus)")


def _backend(variable):
    """The TF variable behind a Keras variable (a TF variable: itself), also inside a Keras
    stateless scope (which would give the value it maps the variable to)."""
    return compat.storage(variable) if isinstance(variable, keras.Variable) else variable


def _with_device(grad, variable):
    """The gradient as a tensor on its variable's device. (A sum over microbatches from several
    devices has none, and tf.distribute's all-reduce needs one: "destinations can not be
    empty" under MultiWorkerMirrored.)"""
    if grad is None or isinstance(grad, tf.IndexedSlices):
        return grad
    with tf.device(variable.device):
        return tf.identity(grad)


@keras.saving.register_keras_serializable("tfdist")
class Pipeline(keras.Model):
    """A GPT split into `stages` on `devices`, trained with `microbatches` per batch (GPipe);
    with `tensor_parallel=t`, each stage's blocks are also split over t devices
    (tfdist.models.tensor_parallel), on a `keras.distribution.DeviceMesh` of shape (stages, t).

    `layers_per_stage`: blocks per stage (default: balanced by compute). `devices`: stages x t
    device names, stage by stage (default: `default_devices`). Build it through
    `tfdist.parallel.layout.Layout.build_model`, which judges the layout first. Checkpoints hold
    the GPT's variables under the GPT's names whatever the layout (tfdist.models.state), so a
    backup of one layout restores into another.
    """

    def __init__(self, gpt, stages=2, microbatches=1, layers_per_stage=None, devices=None,
                 recompute=False, tensor_parallel=1, schedule="gpipe", sequence_parallel=False,
                 **kwargs):
        super().__init__(**kwargs)
        if isinstance(gpt, dict):  # from get_config
            gpt = keras.saving.deserialize_keras_object(gpt)
        if not isinstance(gpt, GPT):
            raise TypeError(f"Pipeline wraps a tfdist GPT, got {type(gpt).__name__}")
        if gpt.built:
            raise ValueError("Pipeline needs an unbuilt GPT: its variables must be created on "
                             "their stages' devices")
        # (a layout is judged by tfdist.parallel.layout, before the model is built for it)
        self.schedule = schedule
        blocks, embed, head = block_costs(gpt)
        counts = list(layers_per_stage or balanced_split(blocks, stages, embed, head))
        t = tensor_parallel
        devices = list(devices or default_devices(stages * t))
        self.gpt = gpt
        self.stages = stages
        self.microbatches = microbatches
        self.layers_per_stage = counts
        self.devices = devices
        self.recompute = recompute
        self.tensor_parallel = t
        self.sequence_parallel = bool(sequence_parallel) and t > 1
        self.mesh = keras.distribution.DeviceMesh((stages, t), ["stage", tp.AXIS], devices)
        self.stage_devices = [list(row) for row in self.mesh.devices]  # [stage][shard]
        self.homes = [row[0] for row in self.stage_devices]  # embed, norms, residuals, head
        starts = np.concatenate([[0], np.cumsum(counts)])
        self.stage_blocks = [list(range(starts[s], starts[s + 1])) for s in range(stages)]
        if t > 1:
            tp.shard_blocks(gpt, [self.stage_devices[s] for s in range(stages)
                                  for _ in self.stage_blocks[s]], tp.megatron_layout(self.mesh))
        self._stage_fns = [self._make_stage(s) for s in range(stages)]

    # -- forward ---------------------------------------------------------------------------------
    def _make_stage(self, s):
        g = self.gpt

        def body(x, training):
            """The stage's blocks, and the head on the last stage."""
            devices = self.stage_devices[s]
            # split along the sequence where it divides (else, as generate() may: whole)
            split = (self.sequence_parallel and x.shape[1] is not None
                     and x.shape[1] % len(devices) == 0)
            if split:
                x = tp.scatter_sequence(x, devices)
            for i in self.stage_blocks[s]:  # (tensor parallel: `tp.parallel_block`)
                x = g.blocks[i](x, training=training)
            if split:
                x = tp.gather_sequence(x, self.homes[s])
            return g.head(x) if s == self.stages - 1 else x

        if self.recompute:  # the embedding (int ids in) stays outside: ids have no gradient
            recomputed = {t: tf.recompute_grad(lambda x, t=t: body(x, t)) for t in (True, False)}
            run = lambda x, training: recomputed[bool(training)](x)  # noqa: E731
        else:
            run = body

        def stage(x, training):
            if s == 0:
                x = g.embed(x, training=training)
            return run(x, training)
        return stage

    def call(self, idx, training=False):
        x = idx
        for s in range(self.stages):
            with tf.device(self.homes[s]):
                x = self._stage_fns[s](x, training)
        return x

    def build(self, input_shape=None):
        """Creates every variable on its stage's device (by running the stages once)."""
        if self.built:
            return
        self.built = True
        g = self.gpt
        # two tokens: the shapes need no more (tfdist.models.gpt.GPT.build)
        x = ops.zeros((1, min(2, g.block_size)), dtype="int32")
        for s in range(self.stages):
            with tf.device(self.homes[s]):
                if s == 0:
                    x = g.embed(x)
                for i in self.stage_blocks[s]:
                    if self.tensor_parallel > 1:
                        x = tp.build_block(g.blocks[i], x, self.stage_devices[s])
                    else:
                        x = g.blocks[i](x)
                if s == self.stages - 1:
                    g.head(x)
        g.built = True

    # -- training: the gradients of a batch (tfdist.step runs the rest of the step) -------------
    def compute_gradients(self, x, y, scale=lambda loss: loss, variables=None):
        """(mean loss, gradients of `variables`: default the trainable weights) of batch (x, y)
        in M microbatches. Graph mode only (inside a tf.function, as Keras runs `train_step`)."""
        variables = [_backend(v) for v in variables or self.trainable_weights]
        if self.schedule == "1f1b":
            return self._one_forward_one_backward(x, y, scale, variables)
        m = self.microbatches
        xs, ys = tf.split(x, m), tf.split(y, m)
        losses = [self.compute_loss(xi, yi, self(xi, training=True), training=True)
                  for xi, yi in zip(xs, ys)]
        loss = tf.add_n(losses) / m
        # tf.gradients, not GradientTape: it places each backward op with its forward op.
        grads = tf.gradients(scale(loss), variables)
        return loss, [_with_device(g, v) for g, v in zip(grads, variables)]

    def _one_forward_one_backward(self, x, y, scale, variables):
        """Megatron-LM's 1F1B schedule (Narayanan et al. 2021, fig. 4) in one graph: each
        microbatch's gradient is its own `tf.gradients`, and control dependencies make stage s
        start the forward of microbatch j only after it has finished the backward of microbatch
        j - (K - s). So stage s holds at most K - s microbatches' activations (GPipe: all M), and
        the gradients are GPipe's: the same sum, accumulated microbatch by microbatch."""
        m, k = self.microbatches, self.stages
        stage_vars = [[i for i, v in enumerate(variables) if self.stage_of(v) == s]
                      for s in range(k)]
        var_stage = {i: s for s in range(k) for i in stage_vars[s]}
        done = []  # done[j][s]: stage s finished microbatch j's backward
        losses = []
        total = [None] * len(variables)  # the gradients summed over the microbatches so far
        for j, (xj, yj) in enumerate(zip(tf.split(x, m), tf.split(y, m))):
            h = xj
            inputs = []  # each stage's input
            for s in range(k):
                with tf.device(self.homes[s]):
                    if j - (k - s) >= 0:
                        with tf.control_dependencies([done[j - (k - s)][s]]):
                            h = tf.identity(h)
                    inputs.append(h)
                    h = self._stage_fns[s](h, True)
            loss = self.compute_loss(xj, yj, h, training=True)
            losses.append(loss)
            grads = tf.gradients(scale(loss / m), variables + inputs[1:])
            grads, input_grads = grads[:len(variables)], grads[len(variables):]
            done.append([tf.group([grads[i] for i in stage_vars[s] if grads[i] is not None]
                                  + ([input_grads[s - 1]] if s else [])) for s in range(k)])
            # Accumulate now, so this microbatch's gradients are freed. Each sum waits for the
            # previous microbatch's backward: Grappler's arithmetic optimizer would otherwise merge
            # the chain of sums into one AddN of all M gradients, holding them all (measured: the
            # 1F1B peak grew 1.8x from M=4 to 16); it leaves nodes driven by control dependencies.
            for i, g in enumerate(grads):
                if g is not None:
                    with tf.device(variables[i].device), \
                            tf.control_dependencies([done[-1][var_stage[i]]]):
                        g = tf.convert_to_tensor(g)
                        total[i] = g if total[i] is None else total[i] + g
        return tf.add_n(losses) / m, total

    # -- reporting -------------------------------------------------------------------------------
    def num_params(self, non_embedding=False):
        return self.gpt.num_params(non_embedding=non_embedding)

    def flops_per_token(self, seq_len=None):
        return self.gpt.flops_per_token(seq_len)

    def describe(self):
        parts = []
        for s, blocks in enumerate(self.stage_blocks):
            what = (["embed"] if s == 0 else []) + [f"blocks {blocks[0]}-{blocks[-1]}"] + \
                   (["head"] if s == self.stages - 1 else [])
            parts.append(("" if self.stages == 1 else f"stage {s}: ") + " + ".join(what) +
                         " on " + " + ".join(self.stage_devices[s]))
        t = self.tensor_parallel
        if self.stages == 1 and self.microbatches == 1 and t > 1:
            return (f"tensor parallel over {t} devices"
                    + (", sequence parallel" if self.sequence_parallel else "") + ": " + parts[0])
        return (f"pipeline of {self.stages} stages, {self.microbatches} microbatch(es)"
                + (f", tensor parallel over {t} devices per stage" if t > 1 else "")
                + (", sequence parallel" if self.sequence_parallel else "")
                + (", 1F1B schedule" if self.schedule == "1f1b" else "")
                + f"{', recomputed' if self.recompute else ''}: " + "; ".join(parts))

    def device_of(self, variable):
        """(stage, shard) of the device holding `variable` (a variable of this model, Keras's or
        its backend's), read from the variable itself."""
        device = tf.DeviceSpec.from_string(_backend(variable).device)
        for s, row in enumerate(self.stage_devices):
            for r, d in enumerate(row):
                want = tf.DeviceSpec.from_string(d)
                if ((want.device_type, want.device_index)
                        == (device.device_type, device.device_index)):
                    return s, r
        return None, None

    def stage_of(self, variable):
        """The stage whose devices hold `variable`."""
        return self.device_of(variable)[0]

    def memory_estimate(self, batch_size, precision="float32", optimizer_slots=2):
        """Estimated peak bytes per device, counted by tfdist.models.arithmetic as `tfdist plan`
        counts them: the parameters on the device (read from the variables) with their gradients
        and optimizer slots (`state_bytes_per_param`), plus the activations kept for the backward
        pass. Per block and microbatch of b sequences those are Korthikanti et al. 2022's
        b*T*C*(34 + 5*H*T/C) bytes in mixed precision (eq. 2; twice that in float32, less without
        dropout masks: `activation_bytes_per_layer`), of which 24 + 5HT/C are split over the t
        tensor-parallel devices and the rest (norms' and residual inputs) stays on the stage's
        first device, or, with sequence parallelism, is split over the t devices too (eq. 4).
        GPipe keeps all M microbatches' (1F1B: at most K - s on stage s; with recomputation, which
        wraps each stage whole, only the stage's input per microbatch, plus one stage's full set
        while it is recomputed), and the last stage each microbatch's float32 logits."""
        g = self.gpt
        arch = g.arch_sizes
        m = self.microbatches
        t = self.tensor_parallel
        tokens = batch_size // m * g.block_size
        per_block = arch.activation_bytes_per_layer(tokens, precision, tp=t,
                                                    sp=self.sequence_parallel)
        # the unsplit part (on a stage's first device only)
        kept = 0 if self.sequence_parallel else arch.activation_bytes_per_layer(
            tokens, precision, tp=float("inf"))
        per_param = sum(arithmetic.state_bytes_per_param(precision, optimizer_slots))
        params = {}
        for v in self.trainable_weights:  # the ones stored here (ZeRO-3: this replica's)
            if compat.has_storage(v):
                params[self.device_of(v)] = params.get(self.device_of(v), 0) + int(np.prod(v.shape))
        out = []
        for s in range(self.stages):
            n = len(self.stage_blocks[s])
            m = (self.microbatches if self.schedule == "gpipe"
                 else min(self.microbatches, self.stages - s))
            for r, device in enumerate(self.stage_devices[s]):
                mine = per_block if r == 0 else per_block - kept  # per block and microbatch
                if self.recompute:
                    input_ = arch.activation_bytes_per_layer(tokens, precision, recompute=True)
                    acts = (m * input_ if r == 0 else 0) + n * mine
                else:
                    acts = m * n * mine
                if s == self.stages - 1 and r == 0:
                    acts += m * arch.logits_bytes(tokens)
                p = params.get((s, r), 0)
                out.append({"stage": s, "shard": r, "device": device, "params": p,
                            "param_state_bytes": int(p * per_param),
                            "activation_bytes": int(acts),
                            "activation_bytes_per_block": int(mine),
                            "total_bytes": int(p * per_param + acts)})
        return out

    def memory_report(self, batch_size, precision="float32"):
        """Per device: the estimate above, and the peak TF measured (`get_memory_info`) where it
        keeps memory stats. A GPU's are its own; logical CPU devices share the host allocator, so
        theirs is the whole process's peak (`measured_scope` says which)."""
        rows = self.memory_estimate(batch_size, precision)
        for row in rows:
            try:
                row["measured_peak_bytes"] = int(
                    tf.config.experimental.get_memory_info(row["device"])["peak"])
            except (ValueError, tf.errors.InvalidArgumentError):
                row["measured_peak_bytes"] = None
            cpu = tf.DeviceSpec.from_string(row["device"]).device_type == "CPU"
            row["measured_scope"] = "process (shared CPU allocator)" if cpu else "device"
        return rows

    def get_config(self):
        return {**super().get_config(), "gpt": keras.saving.serialize_keras_object(self.gpt),
                "stages": self.stages, "microbatches": self.microbatches,
                "layers_per_stage": self.layers_per_stage, "devices": self.devices,
                "recompute": self.recompute, "tensor_parallel": self.tensor_parallel,
                "schedule": self.schedule, "sequence_parallel": self.sequence_parallel}
