"""GPU kernels (Triton). Each has a plain-torch twin beside it, tested against it (tests/test_kernel*_cuda.py).

One dispatch policy for all of them: a kernel runs when ``on(tensor)`` holds (Triton is present, the kernels
are not switched off, the tensor is on a CUDA device) and the kernel's own case fits (each module's
``usable``-style check: shapes, dtypes, strides); otherwise its caller runs the torch twin. ``HAVE_TRITON``
only says whether the kernels could be defined at import."""

try:  # Triton ships with CUDA builds of torch; the CPU machines have none
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

_enabled = HAVE_TRITON


def enabled() -> bool:
    """Whether kernels may run at all (Triton present and not switched off)."""
    return _enabled


def on(*tensors) -> bool:
    """Whether kernels run on these tensors: ``enabled()`` and every one on a CUDA device."""
    return _enabled and all(t.is_cuda for t in tensors)


def set_enabled(flag: bool) -> None:
    """Switch every kernel off (or back on, where Triton exists); their callers then run the torch twins.
    Training uses this (the kernels have no backward). Call it before building a model: the MoE reads it when
    it is built."""
    global _enabled
    _enabled = bool(flag) and HAVE_TRITON
