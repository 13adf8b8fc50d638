"""Runs a program (`python tests/support/own_dir.py BASE program.py args...`) in its own working
directory BASE/<task>: chief0, worker1, ps0 from TF_CONFIG, rank<r> under Horovod, single
otherwise. A test then sees which process wrote what through the program's relative paths.

With TFDIST_TEST_EXIT_AFTER_EPOCH=N the chief ends itself (status 3) right after Keras's
BackupAndRestore has saved epoch N: a run interrupted at a known point, for a restore test."""
import json
import os
import runpy
import sys

base, program = sys.argv[1], sys.argv[2]
task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task")
rank = os.environ.get("HOROVOD_RANK")
name = (f"{task['type']}{task['index']}" if task else f"rank{rank}" if rank is not None
        else "single")
os.makedirs(os.path.join(base, name), exist_ok=True)
os.chdir(os.path.join(base, name))

exit_after = int(os.environ.get("TFDIST_TEST_EXIT_AFTER_EPOCH", "0"))
if exit_after and name in ("single", "chief0", "worker0", "rank0"):
    import keras
    save = keras.callbacks.BackupAndRestore.on_epoch_end

    def on_epoch_end(self, epoch, logs=None):
        save(self, epoch, logs)
        if epoch + 1 == exit_after:
            print(f"own_dir: exiting after epoch {exit_after}", flush=True)
            os._exit(3)
    keras.callbacks.BackupAndRestore.on_epoch_end = on_epoch_end

sys.argv = [program] + sys.argv[3:]
runpy.run_path(program, run_name="__main__")
