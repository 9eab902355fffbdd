"""Programmatic dependent launch (PDL, Hopper and newer) for every kernel of the package.

A decode step is some 900 dependent launches, and without PDL each kernel's programs start only once the one before
it in the stream has finished and drained. Launched with PDL (``launch_pdl``), a kernel is started while its
predecessor finishes; its programs first wait (``griddepcontrol.wait``: until the predecessor has completed and its
writes are visible). So a kernel never reads or writes memory before everything before it in the stream is done: the
same order as plain launches, with the launch latency hidden. (Releasing the next kernel at once after the wait,
``griddepcontrol.launch_dependents``, measured no better: it pays only for a kernel that loads weights before its
wait, which by default none does; see the early-release experiment below.) A kernel that does not wait must never
be launched with PDL: ``args`` gives both keywords together, and ``enter`` is each kernel's first statement (the
experiment's two GEMVs read only their weight before it). Kernels of other libraries (cuBLAS, torch) in between
launch as usual; a PDL kernel after one of them waits for it the same way.

Measured in bench/pdl_gpu.py (H100, one captured graph): 1.17 -> 0.81 us per link of a chain of one-wave kernels
(0.90 releasing at once), 11.2 -> 9.9 us per FP8 GEMV (4096 x 4096) plus a norm, same bits. ``set_enabled(False)``
(decode_floor's ``--no-pdl``) launches everything plainly."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, enabled

_enabled = True
_release = False
_supported: dict[int, bool] = {}

# The early-release experiment (off by default, not yet measured; decode_floor.py --pdl-release is its A/B): with
# it every kernel releases its successor right after its own wait (``griddepcontrol.launch_dependents``), and the
# one-row GEMVs (``fp8_linear._fp8_row_kernel``, ``bf16_gemv._row_kernel``) load their first chunk of weight
# before waiting: no kernel of a step writes a weight, so those loads may run while the predecessor still does,
# and a GEMV's first DRAM round trip hides behind it. Released alone (no kernel loading early) it measured no
# better than waiting (pdl_gpu.py, above).


def set_release(flag: bool) -> None:
    """Release each kernel's successor right after its wait, and let the one-row GEMVs load weights before
    theirs (the early-release experiment above), or not (default)."""
    global _release
    _release = bool(flag)


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
    return _RELEASE if _release else _ON


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
