"""GPU kernels (Triton). Each has a plain-torch twin it is tested against (tests/test_kernels_cuda.py)."""

try:  # Triton ships with CUDA builds of torch; the CPU machines have none
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False
