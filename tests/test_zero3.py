"""ZeRO-3 (tfdist/parallel/zero/weights.py), in one process: each replica holds 1/N of the weights,
counted from its variables; one replica's sharded step equals the plain step, for tfdist's GPT (with
dropout, with gradient accumulation) and for a user's Keras model with BatchNormalization and
Dropout; a weight another replica holds cannot be read by mistake. Two replicas (Horovod,
multi_worker_mirrored), their companions and the resumes are in tests/test_zero.py."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_pipeline import probe
from tests.test_zero import fake, gpt_nano
from tfdist import compat
from tfdist.parallel import zero


def test_each_replica_holds_one_nth_of_the_weights():
    """Counted from the variables that keep storage: every weight on exactly one replica, each
    replica's share within the partition's imbalance of 1/N; the gathered weights a step adds
    are at most two units (the one running and the one prefetched)."""
    for n in (2, 4):
        held, described = [], None
        for r in range(n):
            _, model = gpt_nano()
            total = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
            params = zero.make(3, model, fake(r, n))
            held.append(params.held_parameters())
            assert held[-1] == params.load[r]
            assert all(compat.has_storage(v) == (params.owner[id(v)] == r)
                       for v in model.trainable_variables)
            described = params.describe()
        assert sum(held) == total
        assert max(held) <= total / n * params.imbalance + 1e-6
        assert params.imbalance < 1.25, params.imbalance  # gpt_nano: 1.02 over 2, 1.13 over 4
        block = max(u.parameters for u in params.units)
        assert block < total / 2  # a block, not the model
        assert f"largest unit {block:,} parameters" in described


def test_a_weight_held_elsewhere_cannot_be_read_by_mistake():
    _, model = gpt_nano()
    params = zero.make(3, model, fake(1, 2))
    other = next(v for v in model.trainable_variables if params.owner[id(v)] == 0)
    with pytest.raises(ValueError, match="is held by another replica"):
        np.asarray(other)


def train(model_fn, stage, steps=6, accumulate=1, data=None, **options):
    """Losses and final weights of `steps` batches of the compiled `model_fn()` through tfdist's
    step on one replica, ZeRO-`stage` (with the stage's `options`)."""
    import tfdist.strategies
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    strategy = tfdist.strategies.get("single")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = model_fn()
        TrainStep(model, strategy, Layout(zero=stage, accumulate=accumulate), clipnorm=1.0,
                  collectives=zero.local(), zero_options=options).install()
    history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)
    sharded = zero.of(model)
    values = sharded.full_values() if sharded else [w.numpy() for w in model.weights]
    return history.history["loss"], values


def gpt():
    from tfdist.models.gpt import GPT, loss_fn
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model.build()
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=loss_fn())
    return model


def tokens():
    t = tf.random.stateless_uniform((8, 17), (0, 0), maxval=64, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((t[:, :-1], t[:, 1:])).repeat()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_replica_zero3_step_equals_the_plain_step_of_a_gpt(accumulate):
    """Dropout 0.1: the recomputed forward of each block draws the forward's masks."""
    plain_loss, plain_w = train(gpt, 0, accumulate=accumulate, data=tokens())
    loss, w = train(gpt, 3, accumulate=accumulate, data=tokens())
    assert max(abs(a - b) for a, b in zip(plain_loss, loss)) <= 1e-5, (plain_loss, loss)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain_w, w)) <= 1e-5


def cnn():
    """A user's CNN with BatchNormalization and Dropout. Its convolution has no bias, as is usual
    in front of BatchNormalization: BN subtracts the batch mean, so such a bias has an exact
    gradient of 0, and what a step computes for it is rounding noise (about 1e-9, its sign set
    by the CPU's summation order), which Adam scales to steps of the learning rate's size. Two
    computations of that bias (plain, ZeRO-3) then differ by up to the learning rate on any CPU
    (2.4e-4 measured on an AMD EPYC), and so does BN's moving mean, which follows it; every
    other variable has a defined gradient."""
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Flatten(),
        keras.layers.Dropout(0.25), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_one_replica_zero3_step_equals_the_plain_step_of_a_keras_cnn():
    """A user's Sequential model: its BatchNormalization's moving statistics (updated inside the
    sharded call) and its weights end as the plain step's. Both compute the same float32 sums in
    the same order but in different graphs: the losses (about 2.3) and weights agree within
    3e-7 here, the bound is 1e-5."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
    plain_loss, plain_w = train(cnn, 0, data=data)
    loss, w = train(cnn, 3, data=data)
    assert max(abs(a - b) for a, b in zip(plain_loss, loss)) <= 1e-5, (plain_loss, loss)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain_w, w)) <= 1e-5


def keras_hub_gpt2():
    """keras-hub's GPT-2 causal LM: its head is the backbone's token embedding, reversed (a layer
    of two models, called twice); the backbone is a model nested in the task."""
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is installed by make setup")
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2,
                                             hidden_dim=32, intermediate_dim=64,
                                             max_sequence_length=32, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def gpt2_tokens():
    t = tf.random.stateless_uniform((8, 17), (0, 0), maxval=64, dtype=tf.int32)
    x = {"token_ids": t[:, :-1], "padding_mask": tf.ones_like(t[:, :-1], tf.bool)}
    return tf.data.Dataset.from_tensors((x, t[:, 1:])).repeat()


@keras.saving.register_keras_serializable("tfdist_test")
class Around(keras.layers.Layer):
    """x + inner(x), where `inner` is a layer the model also calls on its own: a unit holding
    another unit's weights."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x):
        return x + self.inner(x)


def shared_layers():
    inner = keras.layers.Dense(8, activation="tanh")
    x = keras.Input((8,))
    h = Around(inner)(inner(inner(x)))  # called twice, then inside another layer
    model = keras.Model(x, keras.layers.Dense(4)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def vectors():
    x = tf.random.stateless_normal((16, 8), (1, 2))
    return tf.data.Dataset.from_tensors((x, x[:, :4] * 2)).repeat()


@pytest.mark.parametrize("model_fn,data", [(keras_hub_gpt2, gpt2_tokens),
                                           (shared_layers, vectors)])
def test_one_replica_zero3_step_equals_the_plain_step_with_shared_layers(model_fn, data):
    """A weight read by two layers, a layer called twice, a model nested in the model: the
    sharded step is the plain one (bitwise here: the same sums in the same order)."""
    plain_loss, plain_w = train(model_fn, 0, data=data())
    loss, w = train(model_fn, 3, data=data())
    assert max(abs(a - b) for a, b in zip(plain_loss, loss)) <= 1e-5, (plain_loss, loss)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain_w, w)) <= 1e-5


@pytest.mark.parametrize("model_fn,data", [(keras_hub_gpt2, gpt2_tokens),
                                           (shared_layers, vectors)])
def test_without_nested_units_shared_layers_fail(model_fn, data):
    """The companion: the units of before (the model's own layers, each gathering its weights
    where it runs): a unit's layer that runs inside another's reads variables inside that unit's
    custom gradient, and the first step fails as it did for keras-hub's GPT-2."""
    with pytest.raises(TypeError, match="grad_fn must accept keyword argument 'variables'"):
        train(model_fn, 3, data=data(), nested=False)


@pytest.mark.parametrize("name,zero", [("mirrored", 3), ("single", 3), ("horovod", 2)])
def test_a_user_model_is_sharded_with_zero_3_under_horovod_or_mwms_only(name, zero):
    import tfdist.strategies
    from tfdist.errors import UsageError
    with pytest.raises(UsageError, match=f"zero={zero} under strategy {name}: a user's model is "
                                         f"sharded with zero=3 under horovod or "
                                         f"multi_worker_mirrored"):
        tfdist.strategies.get(name, zero=zero)


def test_each_sharded_model_has_collectives_of_its_own():
    """Two models sharded in one process name their collectives apart (the same unit, tag and
    graph): TF resolves a collective's shape once per key, so a second model reusing the first's
    keys failed under multi_worker_mirrored ("Shape mismatch in the collective instance")."""
    names = []
    with tf.Graph().as_default():
        for _ in range(2):
            _, model = gpt_nano()
            params = zero.make(3, model, fake(0, 2))
            names.append({params._name(tag, u) for u in params.units for tag in ("fwd", "grad")})
    assert len(names[0]) == len(names[1]) > 0 and not names[0] & names[1]


@pytest.mark.parametrize("args", [("recompute",), ("t=2", "sp", "schedule=1f1b")])
def test_one_replica_zero3_gradients_of_a_pipeline_equal_the_plain_ones(args):
    """A GPT in 2 stages x 2 microbatches (recomputed; or 2 tensor-parallel shards, sequence
    parallel, 1F1B): one replica's ZeRO-3 gradients equal the plain pipeline's, for all 52
    weights (tests/support/pipeline_probe.py)."""
    r = probe("zero3", 2, 2, *args)
    assert r["n"] == 52 and r["loss_diff"] <= 1e-6 and r["max_grad_diff"] <= 1e-5, r


def test_a_read_reused_across_recomputed_stages_loses_its_gradient():
    """Companion: the tied head's gathered embedding, reused by the next microbatch's
    recomputation (a gather recorded under another gradient tape), misses that microbatch's
    gradient (measured 2.6e-2 off)."""
    r = probe("zero3", 2, 2, "recompute", "reuse_reads")
    assert r["max_grad_diff"] > 1e-3, r
