"""StepPlan + storage + ops against a naive reference that keeps every request's full token history.

"The model" is simulated: every token's cache rows are a deterministic encoding of (layer, request,
position, token), the token value carries a per-step salt so a rejected draft's rows differ from whatever
later lands at its position, and a compressed entry is a weighted sum of its window's gathered state rows.
Each step runs the order plan.py documents (gather, then write; write closed entries, then gather them)
and compares every gathered value with what the reference computes from the committed history plus the
step's own tokens.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsv4.cache import (CacheLayout, CacheStorage, KVCacheManager, SeqStep, StalePlanError, gather_combined)
from dsv4.config import get_preset

F32 = torch.float32




def enc(width: int, chunks: int, layer, uid, pos, tok) -> torch.Tensor:
    """Rows [..., chunks*width]: chunk h starts with [1+h, layer, uid, pos, tok], the rest is zero."""
    shape = tuple(torch.as_tensor(pos).shape)
    out = torch.zeros(shape + (chunks, width), dtype=F32)
    for h in range(chunks):
        out[..., h, 0] = 1 + h
        out[..., h, 1] = float(layer)
        out[..., h, 2] = torch.as_tensor(uid, dtype=F32)
        out[..., h, 3] = torch.as_tensor(pos, dtype=F32)
        out[..., h, 4] = torch.as_tensor(tok, dtype=F32)
    return out.reshape(shape + (chunks * width,))


def fake_entry(rows: torch.Tensor, r: int, coff: int, width: int) -> torch.Tensor:
    """rows [M, coff*r, 2*coff*width] (invalid columns already zero) -> [M, width].

    Weighted sum of (kv + score) over the window, taking the A-half ([:width]) of the first r columns and
    the B-half of the last r for CSA (coff=2), the only half for HCA."""
    M = rows.shape[0]
    kv, score = rows[..., :coff * width], rows[..., coff * width:]
    both = (kv + score).reshape(M, coff * r, coff, width)
    half = torch.arange(coff * r) // r                       # 0 for the A columns, 1 for the B columns
    picked = both[:, torch.arange(coff * r), half]           # [M, coff*r, width]
    weight = torch.arange(1, coff * r + 1, dtype=F32)[None, :, None]
    return (picked * weight).sum(1)


class Sim:
    """One manager + storage + the reference history of every live request."""

    def __init__(self, preset="tiny", max_draft_len=3, tokens_per_block=16, num_slots=4, num_blocks=24):
        self.cfg = get_preset(preset)
        self.layout = CacheLayout(self.cfg, max_draft_len, tokens_per_block)
        self.mgr = KVCacheManager(self.layout, num_slots, num_blocks)
        self.store = CacheStorage(self.layout, num_slots, num_blocks, dtype=F32, kv_dtype="fp32")
        self.hist: dict = {}            # uid -> committed token values, one per position
        self.step_no = itertools.count(1)
        self.D, self.dI, self.W = self.cfg.head_dim, self.cfg.index_head_dim, self.cfg.window_size

    # ---- reference content ------------------------------------------------------------------------
    def content_table(self, uids, extra):
        """[B, L] token value per position: committed history, then ``extra[b]`` (this step's tokens)."""
        rows = [self.hist[u] + list(e) for u, e in zip(uids, extra)]
        L = max([len(r) for r in rows] + [1])
        t = torch.full((len(rows), L), -1.0)
        for b, r in enumerate(rows):
            t[b, :len(r)] = torch.tensor(r, dtype=F32)
        return t

    def step(self, specs, pad_tokens_to=None, pad_batch_to=None):
        """specs: list of (uid, num_new, draft_len, accepted). Runs one simulated forward + drafts + commit.

        Returns a dict of everything gathered (real rows only) for run-to-run comparisons.
        """
        salt = next(self.step_no) * 128
        D, dI, W, layout = self.D, self.dI, self.W, self.layout
        uids = [s[0] for s in specs]
        C = [self.mgr.num_computed(u) for u in uids]
        toks = [[salt + k for k in range(n)] for (_, n, _, _) in specs]
        plan = self.mgr.begin_step([SeqStep(u, n, d) for (u, n, d, _) in specs],
                                   pad_tokens_to=pad_tokens_to, pad_batch_to=pad_batch_to)
        B, N = len(specs), sum(s[1] for s in specs)
        Np = plan.positions.shape[0]
        out = {}

        # host-side fields against the reference
        exp_pos = [c + i for c, (_, n, _, _) in zip(C, specs) for i in range(n)]
        exp_seq = [b for b, (_, n, _, _) in enumerate(specs) for _ in range(n)]
        assert plan.positions[:N].tolist() == exp_pos and plan.token_seq[:N].tolist() == exp_seq
        assert plan.positions[N:].eq(0).all() and plan.token_seq[N:].eq(0).all()
        qs = plan.query_start.tolist()
        assert qs[B:] == [N] * (len(qs) - B) and all(qs[b + 1] - qs[b] == specs[b][1] for b in range(B))
        assert plan.last_token_index[:B].tolist() == [qs[b + 1] - 1 for b in range(B)]

        seq = plan.token_seq
        pos = plan.positions
        real = torch.arange(Np) < N
        uid_t = torch.tensor([uids[b] for b in exp_seq] + [999] * (Np - N), dtype=F32)
        tok_t = torch.tensor([t for ts in toks for t in ts] + [-7] * (Np - N), dtype=F32)
        ctab = self.content_table(uids, toks)           # [B, L]
        uid_b = torch.tensor(uids, dtype=F32)

        # ---- SWA, every main layer and (catch-up pass) the MTP layer ------------------------------------
        kp = pos[:, None] - (W - 1) + torch.arange(W)[None, :]                  # [Np, W] key positions
        kvalid = (kp >= 0) & real[:, None]
        assert torch.equal(plan.swa_valid, kvalid)
        seq_c = seq.clamp(max=B - 1)
        for l in range(layout.num_swa_layers):
            step_rows = enc(D, 1, l, uid_t, pos, tok_t)                                  # [Np, D]
            got = self.store.gather_swa(l, step_rows, plan.swa_read, plan.swa_valid)     # [Np, W, D]
            ktok = ctab[seq_c[:, None], kp.clamp(min=0)]
            exp = enc(D, 1, l, uid_b[seq_c][:, None].expand(-1, W), kp, ktok) * kvalid[..., None]
            assert torch.equal(got, exp), f"SWA layer {l}: window mismatch"
            out[f"swa{l}"] = got[:N].clone()
            self.store.write_swa(l, plan.swa_write, step_rows)

        # ---- compressors, entries, indexer ------------------------------------------------------------
        ends = [c + n for c, (_, n, _, _) in zip(C, specs)]
        for r, rt in plan.ratio_tables.items():
            coff, M = layout.coff(r), rt.num_windows
            exp_w = [(b, w) for b in range(B) for w in range(C[b] // r, ends[b] // r)]
            assert M == len(exp_w)
            assert list(zip(rt.win_seq[:M].tolist(), rt.win_index[:M].tolist())) == exp_w
            assert rt.win_pos[:M].tolist() == [w * r for _, w in exp_w]
            assert rt.win_token[:M].tolist() == [qs[b] + (w + 1) * r - 1 - C[b] for b, w in exp_w]
            assert rt.win_active.tolist() == [True] * M + [False] * (rt.win_active.shape[0] - M)
            assert not rt.win_valid[M:].any() and rt.win_write[M:].eq(0).all()
            assert rt.entry_count[:N].tolist() == [(p + 1) // r for p in exp_pos]
            # reference window positions and state rows
            wseq = rt.win_seq[:M]
            q = (rt.win_index[:M] - coff + 1)[:, None] * r + torch.arange(coff * r)[None, :]
            qvalid = q >= 0
            qtok = ctab[wseq[:, None], q.clamp(min=0)]
            # reference entries of every window complete by the end of the step, per request
            n_all = max(e // r for e in ends)
            wa = torch.arange(max(n_all, 1))
            qa = (wa - coff + 1)[:, None] * r + torch.arange(coff * r)[None, :]                    # [Wa, coff*r]
            qa_tok = ctab[:, qa.clamp(min=0).clamp(max=ctab.shape[1] - 1)]                         # [B, Wa, coff*r]
            evalid = rt.entry_valid[:N]
            assert torch.equal(evalid, torch.arange(evalid.shape[1])[None, :] < rt.entry_count[:N, None])
            for l in layout.compressed_layers(r):
                kinds = [("main", self.store.state[l], D, "entries")]
                if r == 4:
                    kinds.append(("index", self.store.index_state[l], dI, "index_keys"))
                for kind, state, width, etab in kinds:
                    lid = l + (100 if kind == "index" else 0)
                    step_state = enc(width, 2 * coff, lid, uid_t, pos, tok_t)
                    got = gather_combined(state, step_state, rt.win_rows, rt.win_valid)    # [Mp, coff*r, 2coff*w]
                    exp = enc(width, 2 * coff, lid, uid_b[wseq][:, None].expand(-1, coff * r), q, qtok)
                    exp = exp * qvalid[..., None]
                    assert torch.equal(got[:M], exp), f"layer {l} {kind}: compressor window rows mismatch"
                    assert not got[M:].any()
                    out[f"win{kind}{l}"] = got[:M].clone()
                    state.index_copy_(0, rt.state_write, step_state)
                    entries = fake_entry(got, r, coff, width)                                 # [Mp, width]
                    if etab == "entries":
                        self.store.write_entries(l, rt.win_write, entries)
                        seen = self.store.gather_entries(l, rt.entry_rows, rt.entry_valid)
                    else:
                        self.store.write_index_keys(l, rt.win_write, entries)
                        seen = self.store.gather_index_keys(l, rt.entry_rows, rt.entry_valid)
                    # expected: entry w of the token's request from the reference content
                    ref_rows = enc(width, 2 * coff, lid, uid_b[:, None, None].expand(-1, *qa.shape),
                                   qa[None].expand(B, -1, -1), qa_tok) * (qa >= 0)[None, :, :, None]
                    ref_ent = fake_entry(ref_rows.reshape(-1, coff * r, 2 * coff * width), r, coff, width)
                    ref_ent = ref_ent.reshape(B, -1, width)                                   # [B, Wa, width]
                    E = evalid.shape[1]
                    if E:
                        exp_e = ref_ent[seq[:N, None], torch.arange(E).clamp(max=ref_ent.shape[1] - 1)[None, :]]
                        exp_e = exp_e * evalid[..., None]
                        assert torch.equal(seen[:N], exp_e), f"layer {l} {kind}: visible entries mismatch"
                    assert not seen[N:].any()
                    out[f"ent{kind}{l}"] = seen[:N].clone()

        # ---- MTP draft steps 2..max draft_len (catch-up pass = the SWA loop above) ---------------------
        acc = [s[3] for s in specs]
        new_lens = [c + a for c, a in zip(C, acc)]
        Bp = plan.slots.shape[0]
        nl = torch.tensor(new_lens + [0] * (Bp - B))
        mtp = layout.mtp_layer
        dl = [s[2] for s in specs]
        ext = [list(self.hist[u]) + toks[b][:acc[b]] for b, u in enumerate(uids)]   # committed after this step
        for j in range(2, max(dl + [0]) + 1):
            t = plan.draft.step_tables(j, nl)
            active = [b < B and dl[b] >= j for b in range(Bp)]
            assert t.active.tolist() == active
            dtok = torch.zeros(Bp)
            for b in range(B):
                if active[b]:
                    assert len(ext[b]) == new_lens[b] + j - 2
                    ext[b].append(salt + 64 + j)
                    dtok[b] = salt + 64 + j
            ptab = torch.full((Bp, max(len(e) for e in ext) + 1), -1.0)
            for b in range(B):
                ptab[b, :len(ext[b])] = torch.tensor(ext[b], dtype=F32)
            p = t.positions
            uid_p = torch.tensor(uids + [999] * (Bp - B), dtype=F32)
            rows = enc(D, 1, mtp, uid_p, p, dtok)
            got = self.store.gather_swa(mtp, rows, t.swa_read, t.swa_valid)
            kpd = p[:, None] - (W - 1) + torch.arange(W)[None, :]
            vd = (kpd >= 0) & torch.tensor(active)[:, None]
            assert torch.equal(t.swa_valid, vd)
            exp = enc(D, 1, mtp, uid_p[:, None].expand(-1, W), kpd, ptab[torch.arange(Bp)[:, None],
                                                                          kpd.clamp(min=0)]) * vd[..., None]
            assert torch.equal(got, exp), f"MTP draft step {j}: window mismatch"
            out[f"draft{j}"] = got[:B].clone()
            self.store.write_swa(mtp, t.swa_write, rows)

        self.mgr.commit_step(plan, acc)
        for b, u in enumerate(uids):
            self.hist[u] = self.hist[u] + toks[b][:acc[b]]
            assert self.mgr.num_computed(u) == len(self.hist[u])
        self.mgr.check_integrity()
        with pytest.raises(StalePlanError):
            self.mgr.commit_step(plan, acc)
        return out

    def admit(self, uid) -> bool:
        ok = self.mgr.admit(uid)
        if ok:
            self.hist[uid] = []
        return bool(ok)

    def free(self, uid):
        self.mgr.free(uid)
        del self.hist[uid]


# ------------------------------------------------------------------------------------------------------
# property test: random op sequences over several concurrent requests
# ------------------------------------------------------------------------------------------------------
MAX_LEN = 72


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_ops_match_reference(data):
    maxd = data.draw(st.integers(0, 3), label="max_draft_len")
    tpb = data.draw(st.sampled_from([16, 32]), label="tokens_per_block")
    num_slots = data.draw(st.integers(1, 4), label="num_slots")
    num_blocks = data.draw(st.integers(2, 10), label="num_blocks")
    sim = Sim(max_draft_len=maxd, tokens_per_block=tpb, num_slots=num_slots, num_blocks=num_blocks)
    mgr = sim.mgr
    uids = itertools.count(1)
    for _ in range(data.draw(st.integers(6, 30), label="num_ops")):
        live = sorted(sim.hist)
        op = data.draw(st.sampled_from(["admit", "step", "step", "step", "step", "free"] if live else ["admit"]))
        if op == "admit":
            free_before = mgr.num_free_slots
            ok = sim.admit(next(uids))
            assert ok == (free_before > 0)
            if not ok:
                event("admit refused")
            assert mgr.num_free_slots == max(0, free_before - 1)
        elif op == "free":
            u = data.draw(st.sampled_from(live))
            blocks, slots = mgr.num_free_blocks, mgr.num_free_slots
            nb = len(mgr.block_table(u))
            sim.free(u)
            assert mgr.num_free_blocks == blocks + nb and mgr.num_free_slots == slots + 1
        else:
            k = data.draw(st.integers(1, len(live)))
            chosen = data.draw(st.permutations(live))[:k]
            specs = []
            for u in chosen:
                c = mgr.num_computed(u)
                kinds = ["prefill", "decode"] + (["verify"] if maxd else [])
                kind = data.draw(st.sampled_from(kinds))
                n = {"prefill": lambda: data.draw(st.integers(1, 24)), "decode": lambda: 1,
                     "verify": lambda: 1 + data.draw(st.integers(1, maxd))}[kind]()
                if c + n > MAX_LEN:
                    continue
                blocks_before = mgr.num_free_blocks
                if not mgr.reserve(u, c + n + maxd):
                    assert mgr.num_free_blocks == blocks_before           # all or nothing
                    assert not mgr.can_reserve(u, c + n + maxd)
                    event("reserve with lookahead refused")
                    if not mgr.reserve(u, c + n):
                        assert mgr.num_free_blocks == blocks_before
                        event("reserve refused")
                        continue
                d = data.draw(st.integers(0, maxd))
                a = data.draw(st.integers(max(1, n - maxd), n))
                specs.append((u, n, d, a))
                if a < n:
                    event(f"{kind} with rejected tokens")
                if d > 1:
                    event("MTP draft steps >= 2")
            if not specs:
                continue
            N, B = sum(s[1] for s in specs), len(specs)
            pad = data.draw(st.booleans())
            sim.step(specs, pad_tokens_to=N + data.draw(st.integers(0, 5)) if pad else None,
                     pad_batch_to=B + data.draw(st.integers(0, 2)) if pad else None)
        mgr.check_integrity()
    for u in sorted(sim.hist):
        sim.free(u)
    mgr.check_integrity()
    assert mgr.num_free_blocks == num_blocks and mgr.num_free_slots == num_slots


# ------------------------------------------------------------------------------------------------------
# rollback of drafts that closed a ratio-4 and a ratio-16 (or 128) window leaves no trace
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,tpb,start", [("tiny", 16, 13), ("tiny-r128", 128, 125)])
def test_rejected_drafts_that_closed_windows_leave_no_trace(preset, tpb, start):
    hca = 16 if preset == "tiny" else 128
    runs = []
    for with_rejected in (True, False):
        sim = Sim(preset=preset, max_draft_len=3, tokens_per_block=tpb, num_slots=2, num_blocks=8)
        for u in (1, 2):
            assert sim.admit(u) and sim.mgr.reserve(u, 4 * tpb)
        # identical history up to position start-1 (request 2 rides along in every step)
        c = 0
        while c < start:
            n = min(9, start - c)
            sim.step([(1, n, 0, n), (2, n, 0, n)])
            c += n
        assert sim.mgr.num_computed(1) == start
        if with_rejected:
            # verify positions start..start+3; the rejected drafts at start+1.. close windows of both ratios
            sim.step([(1, 4, 3, 1), (2, 1, 0, 1)])
            assert (start + 2 + 1) % 4 == 0 and (start + 2 + 1) % hca == 0
            l4, lh = sim.layout.compressed_layers(4)[0], sim.layout.compressed_layers(hca)[0]
            # the rejected windows really were written (so the test exercises rollback, not a no-op)
            slot_block = sim.mgr.block_table(1)
            w4, wh = (start + 3) // 4 - 1, (start + 3) // hca - 1
            epb4, epbh = tpb // 4, tpb // hca
            assert sim.store.entries[l4][slot_block[w4 // epb4] * epb4 + w4 % epb4].any()
            assert sim.store.entries[lh][slot_block[wh // epbh] * epbh + wh % epbh].any()
        else:
            sim.step([(1, 1, 3, 1), (2, 1, 0, 1)])
        # from here both runs execute the same steps with the same token values (same step salts)
        seen = []
        for specs in ([(1, 1, 2, 1), (2, 1, 0, 1)], [(1, 1, 0, 1)], [(1, 4, 3, 2), (2, 3, 0, 3)],
                      [(1, 4, 3, 4)], [(1, 9, 0, 9), (2, 1, 0, 1)], [(1, 2, 1, 1)], [(1, 1, 0, 1)]):
            seen.append(sim.step(specs))
        runs.append(seen)
    for a, b in zip(*runs):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------------------
# the seed's regression: MTP drafts on the very first step of a fresh manager
# ------------------------------------------------------------------------------------------------------
def test_draft_tables_complete_and_consistent_with_decode_plan():
    cfg = get_preset("tiny")
    layout = CacheLayout(cfg, max_draft_len=3, tokens_per_block=16)
    mgr = KVCacheManager(layout, num_slots=3, num_blocks=6)
    for u in ("a", "b"):
        assert mgr.admit(u) and mgr.reserve(u, 16)
    # warmup's first forward: a generation request of 1 + max_draft_len tokens, nothing else called first
    plan = mgr.begin_step([SeqStep("a", 3, 2), SeqStep("b", 3, 1)], pad_batch_to=4, pad_tokens_to=8)
    new_lens = torch.tensor([2, 3, 0, 0])
    t = plan.draft.step_tables(2, new_lens)
    W, S, base = cfg.window_size, layout.swa_cap, plan.swa_step_base
    assert t.swa_read.shape == (4, W) and t.swa_valid.shape == (4, W) and t.swa_write.shape == (4,)
    assert t.active.tolist() == [True, False, False, False]        # b asked for 1 draft only; 2 pad rows
    assert t.positions.tolist() == [2, 0, 0, 0]
    assert not t.swa_valid[1:].any() and t.swa_read[1:].eq(0).all() and t.swa_write[1:].eq(0).all()
    assert t.swa_read.max() < base + 4 and t.swa_read.min() >= 0
    assert t.swa_read[~t.swa_valid].eq(0).all()
    # row a drafts position 2 after committing 0..1: its window is its ring rows of 0 and 1 (then this step's row)
    s0 = plan.slots[0].item()
    assert t.swa_read[0, t.swa_valid[0]].tolist() == [s0 * S + 0, s0 * S + 1, base + 0]
    with pytest.raises(ValueError, match="catch-up"):
        plan.draft.step_tables(1, new_lens)
    mgr.commit_step(plan, [2, 3])

    plan2 = mgr.begin_step([SeqStep("a", 3, 3), SeqStep("b", 2, 3)])
    nl = torch.tensor([5, 4])                                       # C + accepted
    mgr.commit_step(plan2, [3, 1])
    decode = mgr.begin_step([SeqStep("a", 1), SeqStep("b", 1)])
    t2 = plan2.draft.step_tables(2, nl)
    assert t2.active.all()
    assert torch.equal(t2.positions, decode.positions)
    assert torch.equal(t2.swa_read, decode.swa_read) and torch.equal(t2.swa_valid, decode.swa_valid)
    assert torch.equal(t2.swa_write, decode.swa_write)
    mgr.commit_step(decode, [1, 1])
    # draft step j reads the positions of draft steps 2..j-1 from the ring
    t3 = plan2.draft.step_tables(3, nl)
    assert t3.positions.tolist() == [6, 5]
    s_a = plan2.slots[0].item()
    assert t3.swa_read[0, W - 2].item() == s_a * S + 5 % S and t3.swa_read[0, W - 1].item() == base + 0


def test_stale_and_foreign_plans_are_refused():
    layout = CacheLayout(get_preset("tiny"), max_draft_len=2, tokens_per_block=16)
    m1, m2 = KVCacheManager(layout, 2, 4), KVCacheManager(layout, 2, 4)
    for m in (m1, m2):
        assert m.admit("x") and m.reserve("x", 16)
    plan = m1.begin_step([SeqStep("x", 3, 2)])
    with pytest.raises(StalePlanError, match=r"manager #%d.*not by this one \(#%d\)" % (m1.uid, m2.uid)):
        m2.commit_step(plan, [3])
    plan.check_current(m1)
    m1.commit_step(plan, [2])
    with pytest.raises(StalePlanError, match=r"step 0 is stale: no plan is active \(next step 1\)"):
        m1.commit_step(plan, [2])
    with pytest.raises(StalePlanError):
        plan.check_current(m1)
    p2 = m1.begin_step([SeqStep("x", 1)])
    with pytest.raises(StalePlanError, match="step 0 is stale: the active plan is step 1"):
        m1.commit_step(plan, [1])
    m1.commit_step(p2, [1])
    assert m1.num_computed("x") == 3
