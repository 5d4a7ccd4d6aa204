"""One OpenMP team in the process: the engine thread's.

torch runs its CPU ops (and batchtop's C++ kernels theirs) on libgomp, which keeps a team of worker
threads for each thread that ever ran a parallel region. When the process holds more of those threads
than it has CPUs, libgomp stops spinning between regions: a worker sleeps at once and every parallel
region of a step pays a futex wake-up. The model is loaded (and the engine built) on one thread and
stepped on another (the dashboard loads on a worker thread that outlives the load), so two teams
exist. On 2 CPUs that doubled a 1- or 2-row decode step (smollm2 7.2-8.8 against 14.6-18.8 ms, 300
sleeps a step; 16 rows 1.25x; docs/benchmarks.md, "One OpenMP team"). So the thread that built the
engine gives its workers back as the build ends, and the thread that starts the engine's thread does
so again before it starts (OpenMP 5's omp_pause_resource_all; a later parallel region on either makes
a new team).
"""
from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None (another OpenMP runtime, another OS)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps
                     if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    if len(paths) != 1:
        return None
    library = ctypes.CDLL(paths.pop())
    return library if hasattr(library, "omp_pause_resource_all") else None


def release_workers() -> bool:
    """Free the calling thread's OpenMP workers; True when they were freed (or there were none)."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
