"""The dense reference backend: every key built from the full sequence, no cache. Simple on purpose:
it is the oracle the cached engine is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import Compressor, attend_gathered, select_top_gathered


class DenseBackend:
    """B sequences of T tokens each, all starting at position 0. Tokens are laid out [B*T] (row-major)."""

    def __init__(self, batch: int, seqlen: int, window: int, device):
        self.B, self.T, self.window_size = batch, seqlen, window
        t = torch.arange(seqlen, device=device)
        self.positions = t.repeat(batch)  # [N]
        self.rope_memo = {}
        # key j visible from query t iff t - window < j <= t
        diff = t.view(-1, 1) - t.view(1, -1)
        self._window_mask = ((diff >= 0) & (diff < window)).expand(batch, -1, -1)  # [B, T, T]

    def group(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(self.B, self.T, *x.shape[1:])

    def ungroup(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.B * self.T, *x.shape[2:])

    attend = staticmethod(attend_gathered)
    select_top = staticmethod(select_top_gathered)

    def kv_destination(self, layer_id: int) -> None:
        """None: the window is this step's kv itself."""

    def window(self, layer_id: int, kv: torch.Tensor):
        return self.group(kv), self._window_mask

    def write_window(self, layer_id: int, kv: torch.Tensor) -> None:
        """Nothing: the dense path keeps no cache."""

    def write_compressed(self, layer_id: int, name: str, comp: Compressor, rows: torch.Tensor) -> None:
        """Nothing: the dense path keeps no cache."""

    def state_destination(self, layer_id: int, name: str, ratio: int) -> None:
        """None: no cache."""

    def compressed(self, layer_id: int, name: str, comp: Compressor, rows: torch.Tensor):
        kv, score = rows.chunk(2, dim=-1)
        r, B, T = comp.ratio, self.B, self.T
        E = T // r  # complete windows only
        if E == 0:
            return kv.new_zeros(B, 0, comp.head_dim), torch.zeros(B, T, 0, dtype=torch.bool, device=kv.device)
        kv, score = self.group(kv)[:, : E * r], self.group(score)[:, : E * r]  # [B, E*r, C]
        if comp.coff == 2:  # window w pools tokens (w-1)r .. (w+1)r-1: prepend one empty window, then slide
            kv = F.pad(kv, (0, 0, r, 0))
            score = F.pad(score, (0, 0, r, 0))
            rows_kv = kv.unfold(1, 2 * r, r).transpose(-1, -2)  # [B, E, 2r, C]
            rows_score = score.unfold(1, 2 * r, r).transpose(-1, -2)
            valid = torch.ones(E, 2 * r, dtype=torch.bool, device=kv.device)
            valid[0, :r] = False
        else:
            rows_kv = kv.view(B, E, r, -1)
            rows_score = score.view(B, E, r, -1)
            valid = torch.ones(E, r, dtype=torch.bool, device=kv.device)
        w = torch.arange(E, device=kv.device)
        entries = comp.pool(rows_kv.flatten(0, 1), rows_score.flatten(0, 1), valid.repeat(B, 1),
                            (w * r).repeat(B)).view(B, E, -1)
        t = torch.arange(T, device=kv.device)
        visible = (w.view(1, -1) < ((t + 1) // r).view(-1, 1)).expand(B, -1, -1)  # [B, T, E]
        return entries, visible
