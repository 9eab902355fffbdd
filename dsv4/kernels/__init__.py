"""GPU kernels (Triton). Each has a plain-torch twin it is tested against (tests/test_kernels_cuda.py)."""

try:  # Triton ships with CUDA builds of torch; the CPU machines have none
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

_MODULES = ("expand", "gate", "indexer", "mhc", "moe", "norm", "pool", "project", "rope", "sparse_attention", "swiglu")


def set_enabled(enabled: bool) -> None:
    """Switch every kernel off (or back on, where Triton exists): each kernel's callers test its module's
    ``HAVE_TRITON``, so with it off they run the torch twins. Training uses this (the kernels have no backward);
    call it before building a model (the MoE reads the switch when it is built)."""
    import importlib
    import sys

    on = bool(enabled) and _TRITON_FOUND
    sys.modules[__name__].HAVE_TRITON = on
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}").HAVE_TRITON = on


_TRITON_FOUND = HAVE_TRITON
