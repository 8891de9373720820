"""The environment of a worker process (DESIGN.md "Processes"): the coordinator's own, with the GPU
visibility it was started with (``hide_gpus`` hides every GPU from the coordinator's process, and
``worker_environ`` gives the workers the original values back), the OpenMP wait of its compute
threads (``compute_env``) and its own device (``device_env``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

OPENMP_SPIN_COUNT = "3000"
"""``GOMP_SPINCOUNT`` of every worker whose coordinator's environment sets no OpenMP wait
(``compute_env``): how many times an idle OpenMP thread polls (about 0.1 ms) before it sleeps."""


def compute_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a worker's compute threads: ``GOMP_SPINCOUNT=3000`` unless ``environ``
    (default the coordinator's own) sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``, which then
    pass through unchanged.

    llama.cpp's CPU backend computes each step in an OpenMP team and joins its threads at
    ``omp barrier`` between operations. libgomp's default has an idle thread poll 300,000 times
    (milliseconds) before sleeping: with as many compute threads as cores (DESIGN.md "Processes"),
    that holds the core the worker's link thread, the coordinator and the clients need between two
    steps, and when the kernel preempts a team thread its partner spins through the barrier
    instead of yielding. Passive threads (no polling) pay a futex wake at every barrier instead.
    Measured on the default model, 1 stream, 2 threads, 2 cores (``bench/bench_openmp_wait.py``):
    at load ~3, 57.5 tok/s with 3,000 polls, 56.7 with 300,000 (one run 7.8), 49.6 passive; with
    other work taking the cores, 40.0 with 3,000, 13.1 with 300,000 (runs of 0.5), 33.8 passive."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    return {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}


GPU_VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
"""The variables through which the CUDA and ROCm runtimes choose the devices a process sees."""
NO_GPU = "-1"
"""A device list that names no valid device: the runtime sees none."""
_started_with: dict[str, str | None] = {}


def hide_gpus() -> None:
    """Hide every GPU from the coordinator's own process (DESIGN.md "Processes": each worker owns
    its device). The coordinator loads llama.cpp only for vocabularies (``GgufTokenizer``), but a
    GPU build enumerates its devices at any model load, vocabulary-only too, which initialises the
    GPU runtime in the coordinator: host memory and start time it never uses. Sets each of
    ``GPU_VISIBILITY`` to ``NO_GPU`` in this process, before anything loads llama.cpp; workers are
    spawned with the values the coordinator was started with (``worker_environ``), other children
    (sandboxes, a libbaseRT tokenizer process) inherit the hidden ones. Idempotent."""
    for key in GPU_VISIBILITY:
        _started_with.setdefault(key, os.environ.get(key))
        os.environ[key] = NO_GPU


def worker_environ() -> dict[str, str]:
    """The coordinator's environment with the GPU visibility it was started with (``hide_gpus``
    changed it for the coordinator only): the base of every worker's environment."""
    env = dict(os.environ)
    for key, value in _started_with.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def device_env(device: str | None) -> dict[str, str]:
    """Environment that gives a worker process only its own GPU (DESIGN.md "Processes": one
    worker per GPU): ``cuda:N`` -> CUDA_VISIBLE_DEVICES=N, ``rocm:N`` / ``hip:N`` ->
    HIP_VISIBLE_DEVICES=N, ``gpu:N`` or a bare ``N`` -> both; ``cpu``, None or anything else ->
    nothing. Set for that child only; the coordinator's own environment is untouched."""
    if not device:
        return {}
    kind, sep, index = device.strip().partition(":")
    if not sep:
        kind, index = "gpu", kind
    if not index.isdigit():
        return {}
    kind = kind.lower()
    if kind == "cuda":
        return {"CUDA_VISIBLE_DEVICES": index}
    if kind in ("rocm", "hip"):
        return {"HIP_VISIBLE_DEVICES": index}
    if kind == "gpu":
        return {"CUDA_VISIBLE_DEVICES": index, "HIP_VISIBLE_DEVICES": index}
    return {}
