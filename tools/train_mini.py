#!/usr/bin/env python3
"""Train ``mini``: a small DeepSeek-V4 (every layer kind, mHC, hash-routed and scored MoE, one MTP layer) on the
Python standard library's sources, with the project's own model code, and write it in DeepSeek's layout.

Two stages, one script:

* ``prepare`` (CPU, seconds): the corpus (every ``.py`` file under this interpreter's stdlib, site-packages
  excluded, sorted, files that are not UTF-8 skipped; held out: the files whose path hashes to 0 mod 50), a
  byte-level BPE tokenizer trained with ``tokenizers`` on the training files with DeepSeek-V4's special tokens
  reserved, both token streams (uint16) and a held-out prompt set. Everything lands in ``--data``, with a
  manifest (file list, sizes, SHA-256 of the corpus) so a run can be checked and repeated.
* ``train`` (GPU, minutes): the model of ``mini_config()`` trained from ``--seed`` on random 1025-token windows
  (the begin-of-sentence token, then 1024 tokens from a random offset).
  (BOS + 1024 tokens from a random offset).
  Losses: next-token cross-entropy + ``--mtp-weight`` x the MTP layer's cross-entropy on token t+2
  (DeepSeek-V3's MTP loss with one module) + the lightning indexers' distillation loss (below). Routed experts
  are balanced without an auxiliary loss: each scored gate's selection bias moves by ``--bias-rate`` towards
  equal load after every step (DeepSeek-V3). Writes config.json, model.safetensors (bf16; mHC and the other
  fp32 tensors stay fp32), tokenizer.json, tokenizer_config.json, README.md (the model card),
  heldout_prompts.jsonl and train_log.json into ``--out``.

How the indexer learns: its top-k is a hard selection, so the language-model loss gives it no gradient. As in
DeepSeek-V3.2, it is distilled from the main attention: for each query of a CSA layer, the target is the main
attention's probability mass on each visible compressed entry (softmax over the entries per head, summed over
heads, renormalised; no gradient), and the loss is KL(target || softmax(indexer scores)). The indexer's inputs
are detached, so this loss trains the indexer alone. For the first ``--dense-frac`` of the steps the CSA layers
attend to every visible entry (dense warm-up, while the indexer learns); after that to the indexer's top-k.

The training forward is the dense reference path (``DeepseekV4.streams`` over ``DenseBackend``) with the
training hooks in ``TrainBackend``; the Triton kernels, which have no backward, are switched off.

    python tools/train_mini.py prepare --data .mini_data
    python tools/train_mini.py train --data .mini_data --out /tmp/mini    # on a GPU; the shipped mini: --steps 2277
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.config import ModelConfig, YarnScaling  # noqa: E402

# DeepSeek-V4's special tokens, reserved at ids 0.. so a chat encoding can use them (bos 0, eos 1 as in config)
SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>"]
BOS, EOS = 0, 1
HELD_OUT_MOD = 50  # a file is held out iff sha256(relative path) % 50 == 0


def mini_config(vocab_size: int = 4096) -> ModelConfig:
    """The ``mini`` architecture: one SWA-only layer, CSA (ratio 4, indexer top-64 of the 256 entries a
    1024-token context has), HCA (ratio 128), CSA; hash routing on layer 0, scored routing after; mHC with 4
    streams; one MTP layer."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=256, num_layers=4, num_heads=8, head_dim=64, rope_dim=16,
        q_lora_rank=128, o_groups=2, o_lora_rank=64, window_size=128, compress_ratios=(0, 4, 128, 4),
        num_mtp_layers=1, index_n_heads=4, index_head_dim=32, index_topk=64, n_routed_experts=8,
        n_experts_per_tok=2, n_shared_experts=1, moe_inter_dim=96, route_scale=1.5, num_hash_layers=1,
        swiglu_limit=10.0, hc_mult=4,
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0, beta_slow=1.0),
        max_position_embeddings=4096,
    )


# ------------------------------------------------------------------------------------------------------------
# prepare: corpus, tokenizer, token streams, held-out prompts
# ------------------------------------------------------------------------------------------------------------
def corpus_files(root: str) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``.py`` file under ``root`` (site-packages excluded), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            out.append((os.path.relpath(path, root), text))
    out.sort()
    return out


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELD_OUT_MOD == 0


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # encode() adds the begin-of-sentence token, as DeepSeek's tokenizer does
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIAL_TOKENS[BOS]} $A",
                                                       special_tokens=[(SPECIAL_TOKENS[BOS], BOS)])
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BOS],
            "eos_token": SPECIAL_TOKENS[EOS], "pad_token": SPECIAL_TOKENS[2], "add_bos_token": True,
            "add_eos_token": False, "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}


def held_out_prompts(files: list[tuple[str, str]], tok, n: int, seed: int) -> list[dict]:
    """Prompts cut from held-out files at the start of a ``def`` body, of mixed lengths (the text before the cut,
    its last 24..700 tokens, on line boundaries)."""
    rng = random.Random(seed)
    cands = []
    for rel, text in files:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i + 1 < len(lines):
                cands.append((rel, lines, i + 1))
    rng.shuffle(cands)
    targets = [24, 48, 96, 140, 200, 300, 450, 700]  # around the window (128) and the HCA ratio (128), past 4*top-k
    out, used = [], set()
    for rel, lines, cut in cands:
        if len(out) == n:
            break
        if (rel, cut) in used:
            continue
        want = targets[len(out) % len(targets)]
        start, prompt = cut, ""
        while start > 0:
            cand = "".join(lines[start - 1:cut])
            if len(tok.encode(cand, add_special_tokens=False).ids) > want:
                break
            start, prompt = start - 1, cand
        if not prompt.strip() or len(tok.encode(prompt, add_special_tokens=False).ids) < want // 2:
            continue
        used.add((rel, cut))
        out.append({"prompt": prompt, "source": rel, "line": cut})
    return out


def write_prompts(path: str, prompts: list[dict], output_tokens: int = 128) -> None:
    """The held-out prompts as a dsv4-bench / trtllm-bench dataset (task_id, prompt, output_tokens)."""
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"task_id": i, "prompt": p["prompt"], "output_tokens": output_tokens}) + "\n")


def prepare(args) -> None:
    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    files = corpus_files(root)
    train = [(r, t) for r, t in files if not is_held_out(r)]
    held = [(r, t) for r, t in files if is_held_out(r)]
    digest = hashlib.sha256()
    for rel, text in files:
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
    tok = train_tokenizer([t for _, t in train], args.vocab_size)
    os.makedirs(args.data, exist_ok=True)

    def stream(part):
        ids = []
        for _, text in part:
            ids.append(BOS)
            ids.extend(tok.encode(text, add_special_tokens=False).ids)
            ids.append(EOS)
        return np.asarray(ids, dtype=np.uint16)

    tr, ho = stream(train), stream(held)
    np.save(os.path.join(args.data, "train.npy"), tr)
    np.save(os.path.join(args.data, "heldout.npy"), ho)
    tok.save(os.path.join(args.data, "tokenizer.json"))
    prompts = held_out_prompts(held, tok, args.num_prompts, args.seed)
    write_prompts(os.path.join(args.data, "heldout_prompts.jsonl"), prompts)
    manifest = {
        "python": sys.version.split()[0], "stdlib": root, "rule": f"sha256(relative path) % {HELD_OUT_MOD} == 0 is held out",
        "files": len(files), "train_files": len(train), "heldout_files": len(held),
        "corpus_bytes": sum(len(t.encode()) for _, t in files), "corpus_sha256": digest.hexdigest(),
        "vocab_size": args.vocab_size, "train_tokens": int(tr.size), "heldout_tokens": int(ho.size),
        "heldout_file_list": [r for r, _ in held], "prompt_sources": [[p["source"], p["line"]] for p in prompts],
        "file_list_sha256":
            hashlib.sha256("\n".join(r for r, _ in files).encode()).hexdigest(),
    }
    with open(os.path.join(args.data, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("heldout_file_list", "prompt_sources")},
                     indent=1))
    print(f"prompts: {len(prompts)}; bytes/token on the training files: {manifest['corpus_bytes'] / (tr.size + ho.size):.2f}")


# ------------------------------------------------------------------------------------------------------------
# train
# ------------------------------------------------------------------------------------------------------------
def _init_state(cfg: ModelConfig, seed: int) -> dict:
    """Start from the project's deterministic random init, with training-friendly values where it draws test
    values: norms 1, sinks / ape / gate biases / mHC bases 0, small mHC mixing weights, a small lm head."""
    from dsv4.checkpoint.init_random import random_state_dict

    sd = random_state_dict(cfg, seed=seed)
    for k, v in sd.items():
        leaf = k.rsplit(".", 1)[-1] if "." in k else k
        if k.endswith("norm.weight"):
            v.fill_(1.0)
        elif leaf in ("attn_sink", "ape", "bias") or (leaf.startswith("hc_") and leaf.endswith("_base")):
            v.zero_()
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):
            v.mul_(0.1)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            v.fill_(1.0)
        elif k == "head.weight":
            v.mul_(0.5)
        elif k.endswith("wo_b.weight") or k.endswith(".w2.weight") or k.endswith(".w2"):
            v.mul_(0.5)
    return sd


def build_trainable(cfg: ModelConfig, seed: int, device):
    from dsv4.model.model import DeepseekV4

    with torch.device("meta"):
        model = DeepseekV4(cfg, with_mtp=True)
    model.load_state_dict({k: v.to(device) for k, v in _init_state(cfg, seed).items()}, strict=True, assign=True)
    model.init_tables(device)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("gate.bias"))  # moved by the balancing rule, not by gradients
    # the indexers learn from their distillation loss alone: detach what they read
    detach = lambda m, a: tuple(x.detach() for x in a)  # noqa: E731
    for blk in model.layers:
        ix = blk.attn.indexer
        if ix is not None:
            for lin in (ix.wq_b, ix.weights_proj, ix.compressor.wkv, ix.compressor.wgate):
                lin.register_forward_pre_hook(detach)
    return model


def make_train_backend():
    from dsv4.model.dense import DenseBackend
    from dsv4.model.attention import attend_gathered
    from dsv4.model.ops import index_scores, topk_mask

    class TrainBackend(DenseBackend):
        """The dense backend plus the indexer's distillation: ``select_top`` scores every entry (with gradient)
        and keeps the scores for ``attend``, which compares them with the main attention's distribution."""

        def __init__(self, B, T, window, device, dense_csa: bool):
            super().__init__(B, T, window, device)
            self.dense_csa, self.pending, self.kl = dense_csa, None, []

        def select_top(self, compressed, q, w, keys, k):
            entries, visible = compressed
            scores = index_scores(q, w, keys, q.shape[-2], q.shape[-1])  # [B, T, E]
            self.pending = (scores, visible)
            return entries, (visible if self.dense_csa else topk_mask(scores.detach(), visible, k))

        def attend(self, q, window, compressed, sink, scale):
            if self.pending is not None:
                scores, visible = self.pending
                self.pending = None
                entries = compressed[0]
                with torch.no_grad():
                    logits = torch.einsum("gthd,ged->gthe", q.float(), entries.float()) * scale
                    logits = logits.masked_fill(~visible.unsqueeze(2), float("-inf"))
                    p = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # [B, T, E]
                    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
                rows = visible.any(-1)  # queries that see at least one entry
                logq = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
                kl = (torch.xlogy(p, p) - torch.where(visible, p * logq, torch.zeros_like(p))).sum(-1)
                self.kl.append(kl[rows].mean())
            return attend_gathered(q, window, compressed, sink, scale)

    return TrainBackend


def forward_losses(model, backend_cls, x: torch.Tensor, dense_csa: bool):
    """x: [B, T+1] tokens -> (main CE, MTP CE, indexer KL, main logits argmax agreement stats)."""
    B, L = x.shape
    T = L - 1
    inp, tgt = x[:, :T], x[:, 1:]
    be = backend_cls(B, T, model.cfg.window_size, x.device, dense_csa)
    X = model.streams(inp.reshape(-1), be)  # [B*T, n, d]
    logits = model.logits_from_streams(X)  # [B*T, V]
    ce = F.cross_entropy(logits, tgt.reshape(-1))
    # MTP: row t (0..T-2) from the main streams at t and token t+1 predicts token t+2
    Xg = X.view(B, T, *X.shape[1:])[:, : T - 1].reshape(-1, *X.shape[1:])
    be_m = backend_cls(B, T - 1, model.cfg.window_size, x.device, dense_csa)
    Xm = model.mtp_streams(Xg, inp[:, 1:].reshape(-1), be_m)
    mlogits = model.mtp_logits_from_streams(Xm)
    mce = F.cross_entropy(mlogits, x[:, 2:].reshape(-1))
    kl = torch.stack(be.kl).mean() if be.kl else logits.new_zeros(())
    with torch.no_grad():  # teacher-forced draft agreement: MTP argmax at t == main argmax at t+1
        main_next = logits.view(B, T, -1)[:, 1:].argmax(-1)
        agree = (mlogits.view(B, T - 1, -1).argmax(-1) == main_next).float().mean()
    return ce, mce, kl, agree


class Balancer:
    """Aux-loss-free balancing (DeepSeek-V3): after each step, every scored gate's selection bias moves by
    ``rate`` towards equal expert load (sign of the load gap)."""

    def __init__(self, model, rate: float):
        self.rate, self.loads, self.gates = rate, {}, []
        for blk in list(model.layers) + list(model.mtp):
            g = blk.ffn.gate
            if not g.is_hash:
                self.gates.append(g)
                g.register_forward_hook(self._hook)

    def _hook(self, gate, args, out):
        ids = out[1]
        cnt = torch.bincount(ids.flatten(), minlength=gate.weight.shape[0]).float()
        self.loads[id(gate)] = self.loads.get(id(gate), 0) + cnt

    @torch.no_grad()
    def step(self) -> float:
        worst = 0.0
        for g in self.gates:
            load = self.loads.pop(id(g), None)
            if load is None:
                continue
            g.bias.add_(self.rate * torch.sign(load.mean() - load))
            worst = max(worst, float(load.max() / load.mean()))
        return worst


def batches(tokens: np.ndarray, B: int, L: int, rng: np.random.Generator):
    """B windows of L tokens: the begin-of-sentence token, then L-1 tokens from a random offset. Prompts are
    encoded with a leading BOS and usually start mid-file, so training sees BOS before any text, not only
    before a file's first line."""
    starts = rng.integers(0, tokens.size - L, size=B)
    return np.stack([np.concatenate(([BOS], tokens[s: s + L - 1])) for s in starts]).astype(np.int64)


@torch.no_grad()
def evaluate(model, backend_cls, tokens: np.ndarray, L: int, max_windows: int, device, B: int = 8) -> dict:
    """Held-out losses over consecutive non-overlapping windows (the same ones every time)."""
    n = min(max_windows, (tokens.size - 1) // L)
    tot = {"loss": 0.0, "mtp_loss": 0.0, "mtp_agree": 0.0}
    count = 0
    for i in range(0, n, B):
        idx = range(i, min(n, i + B))
        x = torch.from_numpy(np.stack([np.concatenate(([BOS], tokens[j * L: j * L + L])) for j in idx])
                             .astype(np.int64)).to(device)
        ce, mce, _, agree = forward_losses(model, backend_cls, x, dense_csa=False)
        tot["loss"] += float(ce) * len(idx)
        tot["mtp_loss"] += float(mce) * len(idx)
        tot["mtp_agree"] += float(agree) * len(idx)
        count += len(idx)
    return {k: v / max(count, 1) for k, v in tot.items()} | {"windows": count, "tokens": count * L}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(args) -> None:
    from dsv4 import kernels
    from dsv4.checkpoint.io import write_checkpoint

    kernels.set_enabled(False)  # the Triton kernels have no backward: train on their torch twins
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    with open(os.path.join(args.data, "manifest.json")) as f:
        manifest = json.load(f)
    tr = np.load(os.path.join(args.data, "train.npy"))
    ho = np.load(os.path.join(args.data, "heldout.npy"))
    cfg = mini_config(manifest["vocab_size"])
    model = build_trainable(cfg, args.seed, device)
    n_params = sum(p.numel() for p in model.parameters())
    backend_cls = make_train_backend()
    balancer = Balancer(model, args.bias_rate)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and not n.startswith("hc_")
             and ".hc_" not in n]
    other = [p for n, p in model.named_parameters() if p.requires_grad and all(p is not q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    hparams = {k: v for k, v in vars(args).items() if k not in ("func",)}
    print("hyper-parameters:", json.dumps(hparams))
    print("corpus:", json.dumps({k: manifest[k] for k in ("python", "files", "train_files", "heldout_files",
                                                         "corpus_sha256", "file_list_sha256", "train_tokens",
                                                         "heldout_tokens")}))
    print(f"model: {n_params / 1e6:.2f}M parameters; config {json.dumps(cfg.to_official_dict())}")
    rng = np.random.default_rng(args.seed)
    L = args.seq_len + 1
    total = None if args.steps == "auto" else int(args.steps)
    log, t0, step, timed_from = [], time.time(), 0, None
    while total is None or step < total:
        if total is None and step == args.probe_steps + 5:  # steps/s measured on steps 5..probe+5
            per = (time.time() - timed_from) / args.probe_steps
            total = max(step + 1, int((args.time_budget - (time.time() - t0)) / per) + step)
            print(f"steps: auto -> {total} ({per * 1e3:.0f} ms/step, budget {args.time_budget:.0f} s)", flush=True)
        if step == 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed_from = time.time()
        lr = lr_at(step, total or 10 ** 9, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        dense = step < args.dense_frac * (total or 10 ** 9)
        x = torch.from_numpy(batches(tr, args.batch_size, L, rng)).to(device)
        ce, mce, kl, agree = forward_losses(model, backend_cls, x, dense_csa=dense)
        loss = ce + args.mtp_weight * mce + args.indexer_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        imb = balancer.step()
        if step % args.log_every == 0 or step == (total or 0) - 1:
            rec = {"step": step, "lr": lr, "loss": float(ce), "mtp_loss": float(mce), "indexer_kl": float(kl),
                   "mtp_agree": float(agree), "grad_norm": float(gn), "max_load": imb, "dense_csa": dense,
                   "s": round(time.time() - t0, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        step += 1
    train_s = time.time() - t0
    model.eval()
    ev = evaluate(model, backend_cls, ho, args.seq_len, args.eval_windows, device)
    print("held-out:", json.dumps(ev), flush=True)
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() and v.dtype == torch.float32 else v) for k, v in sd.items()}
    write_checkpoint(args.out, cfg, sd)  # hc_*, sinks, ape, gate biases are written as fp32 by the schema
    shutil.copy(os.path.join(args.data, "tokenizer.json"), os.path.join(args.out, "tokenizer.json"))
    shutil.copy(os.path.join(args.data, "heldout_prompts.jsonl"), os.path.join(args.out, "heldout_prompts.jsonl"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(cfg.max_position_embeddings), f, indent=1)
    result = {"hyper_parameters": hparams, "steps": step, "train_seconds": round(train_s, 1),
              "parameters": n_params, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "heldout": ev, "corpus": manifest,
              "log": log}
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(model_card(cfg, result))
    print(f"wrote {args.out} ({step} steps in {train_s:.0f} s)")


def model_card(cfg: ModelConfig, r: dict) -> str:
    c, h = r["corpus"], r["heldout"]
    hp = " ".join(f"--{k.replace('_', '-')} {r['steps'] if k == 'steps' else v}"
                  for k, v in r["hyper_parameters"].items() if k not in ("cmd", "data", "out", "device", "time_budget",
                                                                        "probe_steps"))
    return f"""# mini: a small DeepSeek-V4 trained on Python's standard library

A {r['parameters'] / 1e6:.2f}M-parameter DeepSeek-V4 ({cfg.num_layers} layers: {', '.join(cfg.layer_kinds)}; window
{cfg.window_size}; CSA ratio 4 with a lightning indexer keeping the top {cfg.index_topk} entries; HCA ratio
{max(cfg.ratios)}; mHC with {cfg.hc_mult} streams; {cfg.n_routed_experts} routed experts (top {cfg.n_experts_per_tok}) + 1
shared, hash-routed on the first {cfg.num_hash_layers} layer; one MTP layer), trained by `tools/train_mini.py` with the
engine's own model code. Weights bf16 (mHC, sinks, compressor position biases and gate biases fp32), in DeepSeek's
checkpoint layout. Licence of the training text: the Python Software Foundation License (the corpus is CPython's
standard library).

- Corpus: the `.py` files of Python {c['python']}'s standard library (site-packages excluded, non-UTF-8 files
  skipped), {c['files']} files, {c['corpus_bytes']} bytes, SHA-256 {c['corpus_sha256']} (file list
  {c['file_list_sha256']}). Held out: the {c['heldout_files']} files whose path hashes to 0 mod {HELD_OUT_MOD}
  ({c['heldout_tokens']} tokens); trained on {c['train_tokens']} tokens.
- Tokenizer: byte-level BPE, {c['vocab_size']} entries, trained with `tokenizers` on the training files;
  DeepSeek-V4's special tokens reserved at ids 0-{len(SPECIAL_TOKENS) - 1}: {', '.join(SPECIAL_TOKENS)}.
  `encode` adds the begin-of-sentence token.
- Training: {r['steps']} steps of {r['hyper_parameters']['batch_size']} x {r['hyper_parameters']['seq_len']} tokens in
  {r['train_seconds']:.0f} s on {r['device']} (torch {r['torch']}); loss = next-token CE + {r['hyper_parameters']['mtp_weight']} x
  MTP CE (token t+2) + the indexers' distillation KL from the main attention (their inputs detached; dense CSA
  attention for the first {r['hyper_parameters']['dense_frac']:.0%} of the steps); aux-loss-free expert balancing.
  Reproduce: `python tools/train_mini.py prepare --data D && python tools/train_mini.py train --data D --out OUT {hp}`.
- Held-out ({h['windows']} windows of {r['hyper_parameters']['seq_len']} tokens): loss {h['loss']:.3f}
  (perplexity {math.exp(h['loss']):.1f}), MTP loss {h['mtp_loss']:.3f}, teacher-forced MTP agreement with the
  main model's next argmax {h['mtp_agree']:.3f}.
- `heldout_prompts.jsonl`: {sum(1 for _ in open(os.path.join(r['hyper_parameters']['data'], 'heldout_prompts.jsonl')))}
  prompts cut from the held-out files at the start of a function body.
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus, tokenizer, token streams, held-out prompts (CPU)")
    p.add_argument("--data", required=True)
    p.add_argument("--stdlib", help="the standard library's directory (default: this interpreter's)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=prepare)
    t = sub.add_parser("train", help="train and write the checkpoint")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", default="auto", help="a number, or auto: as many as --time-budget allows")
    t.add_argument("--time-budget", type=float, default=525.0, help="seconds of training with --steps auto")
    t.add_argument("--probe-steps", type=int, default=20)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=150)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--indexer-weight", type=float, default=1.0)
    t.add_argument("--bias-rate", type=float, default=1e-3)
    t.add_argument("--dense-frac", type=float, default=0.1)
    t.add_argument("--eval-windows", type=int, default=64)
    t.add_argument("--log-every", type=int, default=100)
    t.set_defaults(func=train)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
