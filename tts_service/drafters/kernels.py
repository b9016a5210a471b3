"""The compiled drafters' kernels (numba), loaded beside the model's load.

A process loads a compiled drafter's kernels (numba's import and the cached code, 0.3–0.75 s
on this CPU) at its first draft unless they were loaded before: on a CUDA device
`Generator.load` starts `preload` in a daemon thread before it loads the weights, so the two
overlap. Which kernels a drafter config drafts with its spec declares (`DrafterSpec.kernels`,
`kernels_of`); with no drafter named, `auto`'s on a GPU (`auto_kernels`). On a CPU nothing
preloads (`auto` drafts in Python there and imports no numba).
"""

from __future__ import annotations

import importlib
import threading

from tts_service.drafters.registry import DRAFTER_CONFIGS, KINDS, DrafterConfig, method_drafter


def kernels_of(cfg: DrafterConfig) -> str | None:
    """The module whose `warm()` loads the kernels `cfg` drafts with; None: a Python drafter
    (whether the compiled one applies also depends on the store: a Redis store keeps Python,
    and then the load was for nothing but time beside the model's)."""
    declared = KINDS[cfg.kind].kernels
    return declared(cfg) if declared is not None else None


def auto_kernels() -> str | None:
    """The kernels `auto` drafts with on a GPU."""
    fields = method_drafter("auto", {}, "cuda")
    return kernels_of(DRAFTER_CONFIGS[fields["kind"]](**fields))


def preload(module: str) -> threading.Thread:
    """Load `module`'s kernels (its `warm()`) in a daemon thread. A first draft that comes
    sooner waits on the import lock and numba's compile lock, not a second load."""

    def load() -> None:
        importlib.import_module(module).warm()

    thread = threading.Thread(target=load, name="kernel-preload", daemon=True)
    thread.start()
    return thread
