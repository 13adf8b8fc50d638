"""A resize on Ray without a lost step: before Ray Train restarts a healthy group at another size,
its workers stop after one step they agree on and back it up, as on a preemption signal.

Ray Train V2 resizes an elastic group (`ScalingConfig(num_workers=(min, max))`) by shutting the
running group down and starting one of the new size; it does not tell the workers, and ends them
(`ray.kill`) within seconds. Without this callback the new group resumes from the newest periodic
backup, and the steps after it run again (at least 5 in 1 of 12 grows measured here). With it:

* `StopBeforeResize`, a callback of Ray Train's controller, keeps the running worker group
  (`after_worker_group_start`) and, when the controller is about to carry out a resize decision
  (`before_controller_execute_resize_decision`) while that group is healthy, runs `stop_here` on
  every worker and waits for them;
* `stop_here`, on a worker, asks the run in progress to stop as a preemption signal would
  (`tfdist.runtime.preemption.request_stop`: after the step in progress, the processes agreeing
  on one step, a backup of it), and waits, `timeout` seconds at most, until the run has ended
  (`tfdist.launch.ray_train.worker_loop` sets `ENDED`);
* Ray then shuts the group down and starts the new one, which resumes at that step.

A group that failed (a lost node) has nothing to save: Ray restarts it from the newest backup, as
before. The hooks are Ray Train's developer API (`ray/train/v2/_internal/execution/callback.py`;
RunConfig passes callbacks that are not UserCallbacks to the controller as they are), read in
ray 2.60.0.
"""
import threading
import time

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

ENDED = threading.Event()  # on a worker: its run has ended (set by ray_train.worker_loop)
WHY = "Ray's resize"
# seconds a worker waits for its run to end, beyond the stop's own bound (backup.grace_secs, 30 s
# by default: then the worker exits, and the group resumes from the newest backup before)
TIMEOUT = 60.0


def stop_here(timeout):
    """On a worker: the run in progress stops at an agreed step with a backup; returns the seconds
    until it ended (None: no run was in progress, or it did not end within `timeout` s)."""
    from tfdist.runtime import preemption
    start = time.monotonic()
    if not preemption.request_stop(WHY, "the group of the new size resumes from it"):
        return None
    return round(time.monotonic() - start, 1) if ENDED.wait(timeout) else None


class StopBeforeResize(ControllerCallback, WorkerGroupCallback):
    """In Ray Train's controller: a healthy group backs up its step before Ray resizes it."""

    def __init__(self, timeout=TIMEOUT):
        self.timeout = timeout
        self.group = None

    def after_worker_group_start(self, worker_group):
        self.group = worker_group

    def after_worker_group_shutdown(self, worker_group_context):
        self.group = None

    def after_worker_group_abort(self, worker_group_context):
        self.group = None

    def before_controller_execute_resize_decision(self, resize_decision):
        if self.group is None:
            return
        status = self.group.get_latest_poll_status()
        if status is None or status.errors:
            return  # a failed group: Ray restarts it from the newest backup
        size = len(self.group.get_workers())
        print(f"tfdist: Ray resizes the group from {size} to {resize_decision.num_workers} "
              f"worker(s): its workers back up their step first", flush=True)
        import ray
        try:  # (bounded: a worker lost meanwhile must not hold the controller)
            took = ray.get(self.group.execute_async(stop_here, self.timeout),
                           timeout=self.timeout + 10)
        except Exception as e:  # a worker lost meanwhile: the newest backup, as after a fault
            print(f"tfdist: the group could not back up before the resize ({e!r:.200})", flush=True)
            return
        print(f"tfdist: backed up before the resize (each worker's run ended after {took} s)",
              flush=True)
