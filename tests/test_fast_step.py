"""What makes tfdist's step fast changes no number: the GPT's GELU, LayerNorm and attention with
their gradients written out (tfdist.models.fused; GELU on both its XLA-fused path and its
keras.ops one), the AdamW whose update is one op per variable
(tfdist.optimizers), `single` as TF's default strategy on a CPU. Each is compared with the
textbook or Keras's own computation, and each check is shown to catch a wrong one."""
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.models import fused, gpt


def _grads(fn, x, weights=()):
    """fn(x), and d(sum(fn(x) * w))/d(x, weights) for a fixed random w."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
        loss = tf.reduce_sum(y * tf.random.stateless_normal(tf.shape(y), (1, 2)))
    return [y] + tape.gradient(loss, [x, *weights])


def _close(a, b):
    """The largest difference of each pair, relative to the reference's largest magnitude."""
    out = []
    for p, q in zip(a, b):
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        out.append(float(np.max(np.abs(p - q)) / (np.max(np.abs(q)) + 1e-12)))
    return out


X = tf.random.stateless_normal((4, 16, 48), (0, 1)) * 2.0


@pytest.fixture(params=["xla", "ops"])
def path(request, monkeypatch):
    """A GELU check runs on both of its paths (tfdist.models.fused): XLA-fused (TF, a known
    shape) and keras.ops (another backend, an unknown dimension)."""
    if request.param == "ops":
        monkeypatch.setattr(fused, "_xla", lambda x: False)
    return request.param


def _tanh_gelu_float64(x, w):
    """Keras's tanh GELU, 0.5 x (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3), and the
    gradient of sum(gelu(x) * w), computed in float64: the exact values that a float32 GELU
    should round to."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    k = math.sqrt(2 / math.pi)
    t = np.tanh(k * (x + 0.044715 * x ** 3))
    dy = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    return [0.5 * x * (1 + t), w * dy]


def test_gelu_and_its_gradient_are_kerass_tanh_gelu(path):
    """Against Keras's tanh GELU computed in float64, not against Keras's float32 gradient: that
    one loses precision where 1 + tanh(z) nears 0 (x around -4.5, where tfdist's rewritten form
    does not), by an amount that depends on the CPU's tanh (1.7e-6 of the largest gradient on
    an AMD EPYC). Ours is within 7.4e-7 of float64 there; the bound is 1e-5."""
    w = tf.random.stateless_normal(tf.shape(X), (1, 2))  # (as _grads draws it)
    errors = _close(_grads(gpt.gelu, X), _tanh_gelu_float64(X, w))
    assert max(errors) < 1e-5, errors
    keras_y = keras.activations.gelu(X, approximate=True)  # and it is Keras's function
    assert _close([gpt.gelu(X)], [keras_y])[0] < 1e-5


def _layer_norms():
    ours = gpt.LayerNorm(epsilon=1e-5)
    theirs = keras.layers.LayerNormalization(epsilon=1e-5)
    for layer in (ours, theirs):
        layer.build(X.shape)
        layer.gamma.assign(tf.random.stateless_normal((48,), (2, 3)))
        layer.beta.assign(tf.random.stateless_normal((48,), (4, 5)))
    return ours, theirs


def _layer_norm_errors():
    ours, theirs = _layer_norms()
    return _close(_grads(ours, X, (ours.gamma, ours.beta)),
                  _grads(theirs, X, (theirs.gamma, theirs.beta)))


def test_layer_norm_and_its_gradients_are_kerass():
    errors = _layer_norm_errors()
    assert max(errors) < 1e-5, errors


def test_the_gradient_check_finds_a_wrong_gradient(monkeypatch):
    """The check above, on a LayerNorm whose gradient leaves out one term, fails."""
    @keras.ops.custom_gradient
    def wrong(x):
        xc = x - keras.ops.mean(x, axis=-1, keepdims=True)
        rstd = keras.ops.rsqrt(keras.ops.mean(keras.ops.square(xc), axis=-1, keepdims=True) + 1e-5)

        def grad(dy):
            return rstd * (dy - keras.ops.mean(dy, axis=-1, keepdims=True))  # (no xhat term)
        return xc * rstd, grad
    monkeypatch.setattr(fused, "_normalize", lambda x, epsilon: wrong(x))
    errors = _layer_norm_errors()
    assert errors[0] < 1e-5 and errors[1] > 1e-2  # the output right, the input's gradient wrong


def test_gelu_is_one_xla_compiled_function_each_way(path):
    """On TF with a known shape, GELU's forward and backward are each one XLA-compiled call (so
    one fused loop, not a dozen passes); on the keras.ops path they are separate ops."""
    @tf.function
    def step(x):
        return _grads(gpt.gelu, x)
    graph = step.get_concrete_function(X).graph
    compiled = [op for op in graph.get_operations() if op.type in ("PartitionedCall",
                                                                    "StatefulPartitionedCall")
                and op.get_attr("_XlaMustCompile") if "_XlaMustCompile" in op.node_def.attr]
    sigmoids = [op for op in graph.get_operations() if op.type == "Sigmoid"]
    if path == "xla":
        assert len(compiled) == 2 and not sigmoids
    else:
        assert not compiled and sigmoids


def _textbook_attention(q, k, v, n_head):
    """Scores scaled after the product, the future masked with a select (the GPT's earlier
    code)."""
    B, T, C = q.shape
    hd = C // n_head
    q, k, v = (tf.transpose(tf.reshape(t, (B, T, n_head, hd)), (0, 2, 1, 3)) for t in (q, k, v))
    att = tf.matmul(q, k, transpose_b=True) / math.sqrt(hd)
    att = tf.where(tf.linalg.band_part(tf.ones((T, T), bool), -1, 0), att, -1e9)
    y = tf.matmul(tf.nn.softmax(att, axis=-1), v)
    return tf.reshape(tf.transpose(y, (0, 2, 1, 3)), (B, T, C))


def test_attention_and_its_gradient_are_the_textbook_masked_softmax():
    qkv = tf.random.stateless_normal((2, 16, 3 * 48), (6, 7))
    dropout = keras.layers.Dropout(0.0)

    def ours(x):
        return gpt.attention(*tf.split(x, 3, axis=-1), 4, dropout)

    def theirs(x):
        return _textbook_attention(*tf.split(x, 3, axis=-1), 4)
    errors = _close(_grads(ours, qkv), _grads(theirs, qkv))
    assert max(errors) < 1e-5, errors
    # and a future position changes nothing before it
    later = tf.concat([qkv[:, :10], qkv[:, 10:] + 1.0], axis=1)
    assert np.array_equal(ours(qkv)[:, :10].numpy(), ours(later)[:, :10].numpy())


def _train_adamw(cls, steps=5):
    rng = np.random.default_rng(0)
    names = ["kernel", "bias", "gamma"]
    variables = [keras.Variable(rng.normal(size=s).astype("float32"), name=n)
                 for s, n in zip([(5, 3), (3,), (7,)], names)]
    opt = cls(learning_rate=keras.optimizers.schedules.CosineDecay(1e-2, 100, warmup_target=2e-2,
                                                                   warmup_steps=2),
              weight_decay=0.1, beta_1=0.9, beta_2=0.95)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma"])

    @tf.function
    def step(grads):
        opt.apply(grads, variables)
    for _ in range(steps):
        step([tf.constant(rng.normal(size=v.shape).astype("float32")) for v in variables])
    graph = step.get_concrete_function([tf.TensorSpec(v.shape) for v in variables]).graph
    fused = sum(op.type == "ResourceApplyAdam" for op in graph.get_operations())
    return [v.numpy() for v in variables], fused


def test_adamw_updates_each_variable_in_one_op_as_keras_would():
    from tfdist.optimizers import AdamW
    ours, fused = _train_adamw(AdamW)
    keras_own, none = _train_adamw(keras.optimizers.AdamW)
    assert (fused, none) == (3, 0)  # one fused op per variable; Keras runs its dozen
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(ours, keras_own)) < 1e-6


def test_without_its_patch_row_adamw_runs_kerass_update(monkeypatch):
    """With the row "adam_slots" off, tfdist's AdamW takes Keras's update: the count above
    fails, the numbers stay."""
    from tfdist.compat import table
    from tfdist.optimizers import AdamW
    monkeypatch.setattr(table, "disabled", table.disabled | {"adam_slots"})
    ours, fused = _train_adamw(AdamW)
    keras_own, _ = _train_adamw(keras.optimizers.AdamW)
    assert fused == 0
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(ours, keras_own)) < 1e-6


def test_single_on_a_cpu_is_tfs_default_strategy():
    """`OneDeviceStrategy` on a CPU runs each step as a multi-device function fed by a
    multi-device iterator, 8 % of a gpt_demo step (tools/bench/peer.py)."""
    import tfdist.strategies
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU: single is OneDeviceStrategy there")
    s = tfdist.strategies.get("single")
    assert s.tf_strategy is tf.distribute.get_strategy()
    assert s.describe() == "single: 1 replica on /cpu:0"


def test_gelu_of_bfloat16_is_computed_in_float32(path):
    """A bfloat16 GELU is the GELU computed in float32 and rounded once to bfloat16: within a
    bfloat16 rounding (2^-9 of the value; the bound, 2^-8, leaves room for float32's own last
    bits) of the exact GELU, computed in float64 (Keras's float32 GELU is no reference here: in
    the negative tail it is itself 6.4e-7 off on an AMD EPYC). A GELU computed in bfloat16 is up
    to 2.9e-3 beyond that bound."""
    x = tf.cast(X, tf.bfloat16)
    y = gpt.gelu(x)
    assert y.dtype == tf.bfloat16
    exact = _tanh_gelu_float64(tf.cast(x, tf.float32), np.ones(x.shape))[0]
    np.testing.assert_allclose(y.numpy().astype(np.float64), exact, rtol=2 ** -8, atol=1e-12)


def test_the_bfloat16_check_finds_a_gelu_computed_in_bfloat16():
    """The companion: Keras's GELU of the bfloat16 input (computed in bfloat16) fails it."""
    x = tf.cast(X, tf.bfloat16)
    exact = _tanh_gelu_float64(tf.cast(x, tf.float32), np.ones(x.shape))[0]
    in_bf16 = keras.activations.gelu(x, approximate=True).numpy().astype(np.float64)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(in_bf16, exact, rtol=2 ** -8, atol=1e-12)
