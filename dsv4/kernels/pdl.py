"""Programmatic dependent launch (PDL, Hopper and newer) for every kernel of the package.

A decode step is some 900 dependent launches, and without PDL each kernel's programs start only once the one before
it in the stream has finished and drained. Launched with PDL (``launch_pdl``), a kernel is started while its
predecessor finishes; its programs first wait (``griddepcontrol.wait``: until the predecessor has completed and its
writes are visible). So a kernel never reads or writes memory before everything before it in the stream is done: the
same order as plain launches, with the launch latency hidden. In passes of at most 4 token rows (``pass_rows``:
decode of up to 4 requests, the draft passes and the verify pass of one request at k <= 3) each kernel also
releases its successor at once after its wait, and the row kernels (GEMVs), the router's logits and the mHC partials
load (a first chunk of) their weight before theirs (early release, below). A
kernel that does not wait must never be launched with PDL: ``args`` gives both keywords together, and ``enter`` is
each kernel's first statement (under early release those few read only their weight before it,
``load_weight_and_enter``). Kernels of other libraries (cuBLAS, torch) in between
launch as usual; a PDL kernel after one of them waits for it the same way.

Measured in bench/pdl_gpu.py (H100, one captured graph): 1.17 -> 0.81 us per link of a chain of one-wave kernels
(0.90 releasing at once), 11.2 -> 9.9 us per FP8 GEMV (4096 x 4096) plus a norm, same bits. ``set_enabled(False)``
(decode_floor's ``--no-pdl``) launches everything plainly."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import HAVE_TRITON, enabled

_enabled = True
_release: bool | None = None  # None: early release in passes of at most RELEASE_MAX_ROWS rows; True/False: always/never
_pass_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("dsv4_pdl_pass_rows", default=None)
_supported: dict[int, bool] = {}

# Early release: each kernel releases its successor right after its own wait (``griddepcontrol.launch_dependents``),
# and the row kernels (``fp8_linear._fp8_row_kernel``, ``bf16_gemv._row_kernel``) load their first chunk of
# weight before waiting (since the 26th session also ``gate._gate_logits`` and ``mhc._mix_partials``, not measured
# on their own): no kernel of a step writes a weight, so those loads may run while the predecessor still
# does, and a GEMV's first DRAM round trip hides behind it. Measured on an H100 (flash-L20-E128, FP4 experts, FP8
# linears; decode_floor.py, BENCHMARKS.md 26th session): batch 1, overlapped step 3.67 against 3.99 ms; batch 8
# (no one-row GEMV, only the release) 10.79 against 10.48, and released alone it measured no better than waiting
# in pdl_gpu.py either. So by default only the kernels of passes of at most RELEASE_MAX_ROWS token rows release:
# the rows the row kernels take (``fp8_linear.ROW_MAX_ROWS``, ``bf16_gemv.MAX_ROWS``; one until the 27th session),
# whose early loads are what pays. At 2 rows it measured so too (H100, the MTP k = 1 step of flash-L20-E128, whose
# verify pass has 2 rows; profile_decode.py --mtp 1, one call): 5.27 ms a step releasing in every pass against 5.54
# releasing in its one-row passes only. 3 and 4 rows were not measured.
RELEASE_MAX_ROWS = 4


@contextlib.contextmanager
def pass_rows(rows: int):
    """The kernels launched inside belong to a forward pass of ``rows`` token rows (early release by default
    where rows <= RELEASE_MAX_ROWS). A CUDA graph captured inside keeps the choice."""
    token = _pass_rows.set(int(rows))
    try:
        yield
    finally:
        _pass_rows.reset(token)


def set_release(flag: bool | None) -> None:
    """Early release (above) in every pass (True), in none (False), or in passes of at most RELEASE_MAX_ROWS rows
    (None, the default)."""
    global _release
    _release = None if flag is None else bool(flag)


def releasing() -> bool:
    """Whether kernels launched now release their successors early (``set_release``, ``pass_rows``)."""
    if _release is not None:
        return _release
    rows = _pass_rows.get()
    return rows is not None and rows <= RELEASE_MAX_ROWS


def set_enabled(flag: bool) -> None:
    """Launch kernels with PDL where the device supports it (default) or never."""
    global _enabled
    _enabled = bool(flag)


def _device_supports() -> bool:
    if not (enabled() and torch.cuda.is_initialized()):  # a kernel on a CUDA tensor has initialised CUDA
        return False
    dev = torch.cuda.current_device()
    if dev not in _supported:
        import triton.language as tl

        _supported[dev] = (torch.cuda.get_device_capability(dev)[0] >= 9
                           and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"))
    return _supported[dev]


def args() -> dict:
    """A kernel launch's PDL keywords on the current device: the kernel's ``PDL`` constexpr (``enter`` waits;
    RELEASE: it also releases the successor, and weights may be read before the wait) and, only with it,
    Triton's ``launch_pdl``."""
    if not (_enabled and _device_supports()):
        return _OFF
    return _RELEASE if releasing() else _ON


WAIT, RELEASE = 1, 2  # the PDL constexpr's values (0: plain launches)
_ON, _RELEASE, _OFF = ({"PDL": WAIT, "launch_pdl": True}, {"PDL": RELEASE, "launch_pdl": True},
                       {"PDL": 0})  # read-only: ** copies them at each launch


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def enter(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, wait until the predecessor is done and its writes visible (and
        with RELEASE let the successor's programs start)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PDL == 2:  # RELEASE
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def load_weight_and_enter(ptrs, mask, PDL: tl.constexpr):
        """``enter(PDL)`` and a tile of weight at ``ptrs`` (0 where not ``mask``), a kernel's first memory access:
        with RELEASE the tile is loaded before the wait, as only a weight (written by no kernel of a step) may."""
        if PDL == 2:  # RELEASE
            w = tl.load(ptrs, mask=mask, other=0)
            enter(PDL)
        else:
            enter(PDL)
            w = tl.load(ptrs, mask=mask, other=0)
        return w
