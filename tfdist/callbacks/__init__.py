"""tfdist's Keras callbacks: the step-exact backup (`backup.py`) and its snapshots in the keepers'
memory (`memory.py`), what a run reports (`log.py`),
the loss-spike rollback's watch (`spike.py`), the local-SGD islands' sync (`islands.py`), and
Keras's own file-writing callbacks on a process that is not the chief (`workers.py`).

Example (the first 6 of 10 steps, backed up every 2 steps; a restarted run resumes at step 6):

    >>> import tempfile, keras, tensorflow as tf, tfdist.strategies
    >>> import tfdist.callbacks as cb
    >>> run = tempfile.mkdtemp()
    >>> strategy = tfdist.strategies.get("single")
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     model.optimizer.build(model.trainable_variables)
    >>> data = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    >>> backup = cb.BackupAndRestore(run + "/backup", every_steps=2, total_steps=10)
    >>> start = backup.restore(model)      # model and optimizer built; 0 if there is no backup
    >>> history = strategy.fit(model, data, epochs=3, steps_per_epoch=2, initial_step=start,
    ...                        callbacks=[backup, cb.TrainingLog(run, tokens_per_step=8,
    ...                                                          initial_step=start)], verbose=0)
    >>> start, cb.BackupAndRestore(run + "/backup", total_steps=10).restore(model)
    (0, 6)
"""
from tfdist.callbacks import memory, spike  # noqa: F401
from tfdist.callbacks.backup import BackupAndRestore, model_signature  # noqa: F401
from tfdist.callbacks.log import (  # noqa: F401
    EXTRA_LOG_PREFIX,
    STEPS_KEY,
    ProfileStep,
    Progress,
    StepsPerCall,
    TrainingLog,
    plot_losses,
    read_json,
    steps_in,
    write_json_atomic,
)
from tfdist.callbacks.spike import SpikeWatch  # noqa: F401
from tfdist.callbacks.workers import Calls, ReadOnlyBackup, Scratch  # noqa: F401
