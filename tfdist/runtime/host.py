"""This host: its CPU model, the cores this process may use, the memory a run may take
(`tfdist.plan.auto` plans for them; `tfdist.parallel.budget` fits a user's model in them), and
where tfdist caches what it builds or measures here.

    >>> from tfdist.runtime import host
    >>> cpu, cores = host.this_cpu()
    >>> cores >= 1 and host.host_memory() > 0
    True
"""
import os


def this_cpu():
    """(CPU model name, cores this process may use)."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return name, cores


def host_memory():
    """Bytes of this host's memory a run may take: MemAvailable (the cgroup's limit if lower)."""
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            avail = min(avail, int(limit))
    except (OSError, ValueError):
        pass
    return float(avail)


def cache_dir():
    """Where tfdist keeps what it built or measured on this host: $XDG_CACHE_HOME/tfdist, else
    ~/.cache/tfdist."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tfdist")
