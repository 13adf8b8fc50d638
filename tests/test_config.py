"""Config validation: every bad value is one UsageError naming the key."""
import ml_collections
import pytest

from tfdist import config
from tfdist.errors import UsageError


def test_default_config_is_valid():
    config.validate(config.default_config())


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c.model.__setattr__("n_layer", 0), "model.n_layer"),
    (lambda c: c.model.__setattr__("dropout", 1.5), "model.dropout"),
    (lambda c: c.train.__setattr__("steps", 30), "multiple of train.steps_per_epoch"),
    (lambda c: c.train.__setattr__("warmup_steps", 500), "warmup_steps"),
    (lambda c: c.train.__setattr__("min_learning_rate", 1.0), "min_learning_rate"),
    (lambda c: c.strategy.__setattr__("cross_device_ops", "nccl2"), "cross_device_ops"),
    (lambda c: c.model.__setattr__("vocab_size", -1), "model.vocab_size"),
    (lambda c: c.data.__setattr__("val_fraction", 0.0), "data.val_fraction"),
])
def test_bad_values_name_the_key(mutate, needle):
    c = config.default_config()
    mutate(c)
    with pytest.raises(UsageError, match=needle.replace(".", r"\.")):
        config.validate(c)


def test_unknown_keys_and_wrong_types_from_a_config_file_are_refused():
    c = config.default_config()
    c.model.n_layers = 3  # a typo in a user's config file
    with pytest.raises(UsageError, match="unknown config key 'model.n_layers'"):
        config.validate(c)
    d = config.default_config().to_dict()
    d["train"]["batch_size"] = "32"  # ConfigDict itself refuses this on assignment; a file may not
    c = ml_collections.ConfigDict(d)
    with pytest.raises(UsageError, match="'train.batch_size' must be int"):
        config.validate(c)
    c = config.default_config()
    c.train.learning_rate = 1  # an int where a float is expected is fine
    config.validate(c)
