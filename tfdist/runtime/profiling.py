"""A profiled training step read back: which ops ran when, and whether the gradient all-reduce
overlapped the backward pass.

`--config.train.profile_step=N` has every process capture step N with TF's profiler
(`tfdist.callbacks.ProfileStep`) into `<workdir>/profile/worker-<i>`, which TensorBoard's Profile
tab shows. This module reads that capture (TF's XSpace protobuf), without TensorBoard:

* `read(logdir)`: every op the step ran, with its start and end (microseconds from the capture's
  start) and thread. A synchronous op is one event; an asynchronous op (a collective: TF's
  `CollectiveReduceV2`, Horovod's allreduce) is two in TF's executor trace, its start (issued)
  and its completion, and its span here runs from one to the other.
* `overlap(events)`: the backward pass (ops of the gradient: `gradient_tape/` under Keras's
  `GradientTape`, `gradients/` under `tf.gradients`), the gradient all-reduces (the collectives
  under tfdist's gradient scopes, `GRADIENT_SCOPES`), and how they overlap: how many were
  issued and how many had completed before the last backward op ended, and the share of the
  communication time that ran during the backward pass. An ordering read from the trace, not a
  timing.
* `chrome_trace({worker: events})`: the Trace Event JSON that chrome://tracing and Perfetto open.

Example (a trace of two ops, made by hand):

    >>> from tfdist.runtime import profiling
    >>> events = [profiling.Event("gradient_tape/h_0/MatMul", "MatMul", 0.0, 10.0, "tf_Compute/1"),
    ...           profiling.Event("tfdist_reduce/CollectiveReduceV2", "CollectiveReduceV2",
    ...                           4.0, 12.0, "tf_Compute/1")]
    >>> r = profiling.overlap(events)
    >>> r["issued_during_backward"], r["completed_during_backward"], r["hidden_fraction"]
    (1, 0, 0.75)
"""
import collections
import glob
import os

Event = collections.namedtuple("Event", "name type start end thread")
Event.__doc__ = "One op of a trace: TF node name, op type, start and end (us), thread."

#: Op types of an all-reduce of gradients (TF's collectives, Horovod's).
ALL_REDUCE_TYPES = ("CollectiveReduceV2", "CollectiveReduce", "HorovodAllreduce",
                    "HorovodGroupedAllreduce")
#: Where the backward pass's ops live in a Keras train step (GradientTape) or a pipeline's
#: (tf.gradients).
BACKWARD_SCOPES = ("gradient_tape/", "gradients/")
#: The optimizer's update (Keras's AdamW is `adam_w`; any optimizer's scope ends with its name).
OPTIMIZER_SCOPE = "adam_w/"
#: Where the gradient all-reduces live: tfdist's step reduces every bucket of gradients under
#: `tfdist.parallel.buckets.GRADIENT_SCOPE`; Horovod's collectives take their names from tfdist's
#: own absolute scope (`tfdist/strategies/horovod.py`). Other collectives of a step (the loss's
#: mean, metrics) have neither.
GRADIENT_SCOPES = ("tfdist_reduce", "tfdist_allreduce")


def newest_capture(logdir):
    """The newest `<host>.xplane.pb` under `logdir` (TF's profiler writes
    `plugins/profile/<time>/`); None if there is none."""
    found = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def read(logdir):
    """The ops of the newest capture under `logdir`, sorted by start."""
    from tfdist import compat
    path = newest_capture(logdir)
    if path is None:
        raise FileNotFoundError(f"no profile (*.xplane.pb) under {logdir}")
    space = compat.xspace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    pending = {}  # (step id, op name) -> the halves of an asynchronous op seen so far
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}

        def stats(e, stat_names=stat_names):
            return {stat_names[s.metadata_id]: (stat_names.get(s.ref_value) if s.ref_value
                                                else s.str_value or s.int64_value
                                                or s.uint64_value) for s in e.stats}

        for line in plane.lines:
            base = line.timestamp_ns * 1000  # picoseconds
            for e in line.events:
                start = (base + e.offset_ps) / 1e6
                end = start + e.duration_ps / 1e6
                label = names[e.metadata_id]
                if label.startswith("ExecutorState::ProcessAsync::"):  # an async op's two halves
                    s = stats(e)
                    key = (s.get("step_id"), s.get("name"))
                    half = pending.setdefault(key, {"type": s.get("kernel_type"),
                                                    "thread": line.name})
                    if label.endswith("Start"):
                        half["start"] = start
                    else:
                        half["end"] = end
                elif (":" in label and "::" not in label
                      and not label.startswith(("ExecutorState", "EagerLocalExecute"))):
                    # "node name:op type" (a "Class::Method" label is a runtime's own span)
                    name, _, op_type = label.rpartition(":")
                    if op_type not in ALL_REDUCE_TYPES:  # (a collective's own event: see above)
                        events.append(Event(name, op_type, start, end, line.name))
    for (_, name), half in pending.items():
        if "start" in half and "end" in half and name:
            events.append(Event(name, half["type"], half["start"], half["end"], half["thread"]))
    return sorted(events, key=lambda e: e.start)


def is_backward(event):
    return any(scope in event.name for scope in BACKWARD_SCOPES)


def is_gradient_all_reduce(event, scopes=GRADIENT_SCOPES):
    return event.type in ALL_REDUCE_TYPES and any(s in event.name for s in scopes)


def overlap(events, scopes=GRADIENT_SCOPES):
    """How the gradient all-reduces of one step (the all-reduces under one of `scopes`)
    sat against its backward pass (see the module docstring). Times in us from the capture's
    start."""
    backward = [e for e in events if is_backward(e)]
    reduces = sorted((e for e in events if is_gradient_all_reduce(e, scopes)),
                     key=lambda e: e.start)
    if not backward or not reduces:
        raise ValueError(f"the trace has {len(backward)} backward op(s) and {len(reduces)} "
                         f"gradient all-reduce(s); profile a training step of a multi-process run")
    first, last = min(e.start for e in backward), max(e.end for e in backward)
    busy = sum(e.end - e.start for e in reduces)
    hidden = sum(max(0.0, min(e.end, last) - max(e.start, first)) for e in reduces)
    return {
        "backward_start_us": first,
        "backward_end_us": last,
        "backward_ops": len(backward),
        "last_backward_op": max(backward, key=lambda e: e.end).name,
        "all_reduces": [{"name": e.name, "type": e.type, "start_us": e.start, "end_us": e.end}
                        for e in reduces],
        "issued_during_backward": sum(e.start < last for e in reduces),
        "completed_during_backward": sum(e.end <= last for e in reduces),
        "communication_us": busy,
        "hidden_fraction": hidden / busy if busy else 0.0,
        "exposed_communication_us": max(0.0, max(e.end for e in reduces) - last),
    }


def chrome_trace(workers, pad_us=0.0):
    """Trace Event Format JSON (a dict) of `{worker index: events}`: one process per worker, one
    row per thread; `ph: X` spans in us."""
    out = []
    for worker, events in sorted(workers.items()):
        out.append({"ph": "M", "name": "process_name", "pid": worker,
                    "args": {"name": f"worker {worker}"}})
        for e in events:
            out.append({"ph": "X", "name": e.name, "cat": e.type, "pid": worker, "tid": e.thread,
                        "ts": round(e.start, 3), "dur": round(max(e.end - e.start, 0.0), 3),
                        "args": {"type": e.type, "backward": is_backward(e),
                                 "gradient_all_reduce": is_gradient_all_reduce(e)}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


#: The phases of tfdist's training step (`tfdist.step`), by where their ops live: the backward
#: pass under the gradient's scopes, the update in the step's `update` scope (reduction,
#: corrections, the optimizer), the rest of the step's graph forward.
PHASES = (("backward", BACKWARD_SCOPES), ("update", ("update/", OPTIMIZER_SCOPE)))


def phase(event):
    """"forward", "backward" or "update" (`PHASES`) of one op of a training step."""
    for name, scopes in PHASES:
        if any(s in event.name for s in scopes):
            return name
    return "forward"


#: The threads of TF's executor, where a graph's ops run (the others: Python's, whose events
#: wrap whole function calls, Eigen's pool, tf.data's).
EXECUTOR_THREAD = "tf_Compute"


def where_time_goes(events, top=15):
    """Where one profiled step spent its time: each phase's ops' summed time and span, and the
    `top` op types by summed time (us; the executor's ops only; ops on several threads at once
    each count their own)."""
    phases = {}
    types = collections.Counter()  # op type -> summed time
    counts = collections.Counter()  # op type -> ops
    events = [e for e in events if e.thread.startswith(EXECUTOR_THREAD)]
    for e in events:
        p = phases.setdefault(phase(e), {"op_us": 0.0, "ops": 0, "start": e.start, "end": e.end})
        p["op_us"] += e.end - e.start
        p["ops"] += 1
        p["start"], p["end"] = min(p["start"], e.start), max(p["end"], e.end)
        types[e.type] += e.end - e.start
        counts[e.type] += 1
    total = sum(types.values()) or 1.0
    return {
        "span_us": (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0,
        "op_us": total,
        "phases": {k: {"op_us": v["op_us"], "ops": v["ops"], "span_us": v["end"] - v["start"]}
                   for k, v in phases.items()},
        "types": [{"type": t, "op_us": us, "share": us / total, "ops": counts[t]}
                  for t, us in types.most_common(top)],
    }
