"""Runs a program (`python tests/own_dir.py BASE program.py args...`) in its own working directory
BASE/<task>: chief0, worker1, ps0 from TF_CONFIG, rank<r> under Horovod, single otherwise. A
test then sees which process wrote what through the program's relative paths."""
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
sys.argv = [program] + sys.argv[3:]
runpy.run_path(program, run_name="__main__")
