"""The second stream of a device, for work off the step's critical path while a CUDA graph is captured.

A decode step is a chain of small kernels, most of them too small to fill the GPU; work that nothing needs until
later (the shared expert until the MoE's combine, ``moe.SHARED_OVERLAP``; the mHC Sinkhorn until the sub-block's
write-back, ``mhc.MHC_OVERLAP``) forks onto this stream after its inputs and joins the main stream just before its
output is read: the graph then runs the two branches side by side. Same kernels and inputs, so the same bits.
Outside a capture (eager steps, the CPU) everything stays on the current stream.

A tensor handed to the side stream must stay alive until the join (a block freed on the main stream is reused
in the main stream's order only)."""

from __future__ import annotations

import contextlib

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(x: torch.Tensor, enabled: bool) -> torch.cuda.Stream | None:
    """x's device's side stream while a graph is being captured there and ``enabled``, else None."""
    if not (enabled and x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    if x.device not in _streams:
        _streams[x.device] = torch.cuda.Stream(x.device)
    return _streams[x.device]


def fork(side: torch.cuda.Stream | None, device: torch.device):
    """``with fork(side, device):`` work enqueued inside runs on ``side`` after everything enqueued so far on
    the current stream (None: on the current stream, as ``join(None)`` waits for nothing)."""
    if side is None:
        return contextlib.nullcontext()
    side.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(side)


def join(side: torch.cuda.Stream | None, device: torch.device) -> None:
    """The current stream waits for everything enqueued on ``side`` so far (None: nothing to wait for)."""
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
