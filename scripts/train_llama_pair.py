#!/usr/bin/env python3
"""Trains the llama-architecture model pair that ships with specdec's engine example.

The pair (examples/llama/models/) is a target M_p and a draft M_q for Python code completion,
trained on the Python 3.11 standard-library sources that Debian ships (PSF licence). The
script is the only way the committed files are made; nothing in the build, the tests or the
demo runs it.

Stages (each skipped when its output exists, so an interrupted run resumes; training itself
resumes from its last checkpoint):
  corpus     the .py files of libpython3.11-minimal and libpython3.11-stdlib, in path order;
             every 50th file is held out for validation
  tokenizer  a 4096-token SentencePiece-style BPE vocabulary (llama.cpp's "llama" tokenizer:
             <unk> <s> </s>, 256 byte tokens, characters, merges scored -rank), and the token
             ids of both splits, tokenized with llama.cpp's SPM algorithm
  target     the target: d 384, 6 layers, 6 heads (2 KV heads), SwiGLU 1024, context 512,
             untied output (12.6M parameters); 1400 steps of 8192 tokens, windows of 256
             tokens for the first 1120 steps and of 512 after
  draft      the draft: d 128, 4 layers, 4 heads, SwiGLU 384, tied output (1.4M parameters),
             distilled from the target (cross-entropy against the target's T = 1 rows);
             600 steps of 8192 tokens (256-token windows for the first 480)
  export     both models as F16 GGUF (llama.cpp's names and metadata), the reference logits
             and tokenizations (reference.gguf), the loss curves (CSV), SHA-256 sums

Usage: scripts/train_llama_pair.py [--stage all] [--work-dir build/llama-train]
                                   [--out-dir examples/llama/models] [--quick]
Needs Debian's python3-torch and python3-numpy; install libopenblas0-pthread too (with the
reference BLAS training is about 25x slower). Run it with /usr/bin/python3.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import heapq
import json
import math
import os
import re
import struct
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PACKAGES = ["libpython3.11-minimal", "libpython3.11-stdlib"]
VALIDATION_EVERY = 50  # file i is held out when i % VALIDATION_EVERY == 0
SPACE = "\u2581"  # SentencePiece's visible space

UNK, BOS, EOS = 0, 1, 2
FIRST_BYTE_TOKEN = 3
# llama.cpp token types
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_BYTE = 1, 2, 3, 6


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

def model_configs(quick: bool) -> dict:
    if quick:  # a smoke run of every stage in about a minute
        return {
            "target": dict(dim=64, layers=2, heads=4, kv_heads=2, ffn=128, context=128,
                           tied=False, steps=30, short_steps=20, batch_tokens=1024, lr=3e-3,
                           warmup=5),
            "draft": dict(dim=32, layers=1, heads=2, kv_heads=2, ffn=64, context=128,
                          tied=True, steps=20, short_steps=10, batch_tokens=1024, lr=3e-3,
                          warmup=5),
            "vocab_size": 512,
        }
    return {
        "target": dict(dim=384, layers=6, heads=6, kv_heads=2, ffn=1024, context=512,
                       tied=False, steps=1400, short_steps=1120, batch_tokens=8192, lr=1.5e-3,
                       warmup=100),
        "draft": dict(dim=128, layers=4, heads=4, kv_heads=4, ffn=384, context=512,
                      tied=True, steps=600, short_steps=480, batch_tokens=8192, lr=3e-3,
                      warmup=50),
        "vocab_size": 4096,
    }


ROPE_BASE = 10000.0
RMS_EPS = 1e-5
SEED = 20261124


# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------

def package_versions() -> dict:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}\n", *PACKAGES],
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in out.strip().split("\n"))


def corpus_files() -> list[str]:
    listing = subprocess.run(["dpkg", "-L", *PACKAGES], capture_output=True, text=True,
                             check=True).stdout.split("\n")
    return sorted({p for p in listing if p.endswith(".py") and os.path.isfile(p)})


def read_source(path: str) -> str | None:
    """A file's text with CRLF -> LF; None if it is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n")


def stage_corpus(work: str) -> None:
    path = os.path.join(work, "corpus.json")
    if os.path.exists(path):
        return
    files = corpus_files()
    train, valid, skipped = [], [], []
    for i, name in enumerate(files):
        text = read_source(name)
        if text is None or not text.strip():
            skipped.append(name)
            continue
        (valid if i % VALIDATION_EVERY == 0 else train).append((name, text))
    info = {
        "packages": package_versions(),
        "files": len(files),
        "train_files": len(train),
        "valid_files": len(valid),
        "skipped": skipped,
        "train_chars": sum(len(t) for _, t in train),
        "valid_chars": sum(len(t) for _, t in valid),
    }
    with open(os.path.join(work, "corpus_train.json"), "w") as f:
        json.dump(train, f)
    with open(os.path.join(work, "corpus_valid.json"), "w") as f:
        json.dump(valid, f)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print(f"corpus: {info['train_files']} training files ({info['train_chars']} chars), "
          f"{info['valid_files']} validation files, {len(skipped)} skipped", flush=True)


# --------------------------------------------------------------------------------------
# Tokenizer: BPE training, llama.cpp SPM tokenization
# --------------------------------------------------------------------------------------

# Chunk boundaries: around every newline, and before a run of spaces that follows a
# non-space. No learned token spans a boundary, so llama.cpp's SPM algorithm on the whole
# text (merges only inside vocabulary strings) gives the same tokens as on each chunk.
CHUNK = re.compile("\n|" + SPACE + "+[^" + SPACE + "\n]*|[^" + SPACE + "\n]+")


def escape(text: str) -> str:
    return text.replace(" ", SPACE)


def chunk_counts(texts) -> collections.Counter:
    counts = collections.Counter()
    for text in texts:
        counts.update(CHUNK.findall(escape(text)))
    return counts


def train_bpe(counts: collections.Counter, vocab_size: int, min_char_count: int = 20):
    """Byte-pair merges over chunk counts. Returns (vocabulary strings after the byte tokens,
    in id order: characters first, then merged strings in merge order)."""
    char_counts = collections.Counter()
    for word, n in counts.items():
        for ch in word:
            char_counts[ch] += n
    alphabet = sorted(ch for ch, n in char_counts.items() if n >= min_char_count)
    alphabet_set = set(alphabet)
    budget = vocab_size - FIRST_BYTE_TOKEN - 256 - len(alphabet)
    if budget <= 0:
        raise SystemExit("vocabulary too small for the alphabet")

    words = [list(w) for w in counts]
    freqs = list(counts.values())
    mergeable = set(alphabet)  # characters of the alphabet and merged strings

    pair_counts = collections.Counter()
    where = collections.defaultdict(set)
    for index, (symbols, n) in enumerate(zip(words, freqs)):
        for pair in zip(symbols, symbols[1:]):
            if pair[0] in mergeable and pair[1] in mergeable:
                pair_counts[pair] += n
                where[pair].add(index)
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    while len(merges) < budget and heap:
        negative, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative:
            continue  # stale entry
        merged = pair[0] + pair[1]
        if merged in mergeable:  # the string exists already (another pair made it)
            del pair_counts[pair]
            continue
        merges.append(merged)
        mergeable.add(merged)
        touched = set()
        for index in where.pop(pair, ()):
            symbols, n = words[index], freqs[index]
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            if len(out) == len(symbols):
                continue  # stale index
            for old in zip(symbols, symbols[1:]):
                if old[0] in mergeable and old[1] in mergeable and old != pair:
                    pair_counts[old] -= n
                    touched.add(old)
            for new in zip(out, out[1:]):
                if new[0] in mergeable and new[1] in mergeable:
                    pair_counts[new] += n
                    where[new].add(index)
                    touched.add(new)
            words[index] = out
        pair_counts.pop(pair, None)
        for p in sorted(touched):
            n = pair_counts.get(p, 0)
            if n > 0:
                heapq.heappush(heap, (-n, p))
            else:
                pair_counts.pop(p, None)
    return alphabet, merges


class SpmTokenizer:
    """llama.cpp's SPM tokenizer ("llama" model): symbols are UTF-8 characters; repeatedly
    merge the adjacent pair whose concatenation is a vocabulary string with the highest
    score (ties: leftmost); symbols that are not tokens fall back to byte tokens."""

    def __init__(self, tokens: list[str], scores: list[float]):
        self.tokens = tokens
        self.scores = scores
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.cache: dict[str, list[int]] = {}

    def encode_chunk(self, text: str) -> list[int]:
        cached = self.cache.get(text)
        if cached is not None:
            return cached
        symbols = list(text)
        n = len(symbols)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n
        heap = []

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = symbols[left] + symbols[right]
            token = self.ids.get(merged)
            if token is None:
                return
            heapq.heappush(heap, (-self.scores[token], left, right, len(merged)))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not alive[left] or not alive[right] or \
                    len(symbols[left]) + len(symbols[right]) != size or nxt[left] != right:
                continue
            symbols[left] += symbols[right]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        out = []
        i = 0
        while i != -1 and i < n:
            piece = symbols[i]
            token = self.ids.get(piece)
            if token is not None:
                out.append(token)
            else:  # a character without a token: its UTF-8 bytes
                out.extend(FIRST_BYTE_TOKEN + b for b in piece.encode("utf-8"))
            i = nxt[i]
        self.cache[text] = out
        return out

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        out = [BOS] if add_bos else []
        for chunk in CHUNK.findall(escape(text)):
            out.extend(self.encode_chunk(chunk))
        return out

    def decode(self, ids) -> str:
        data = bytearray()
        for t in ids:
            if FIRST_BYTE_TOKEN <= t < FIRST_BYTE_TOKEN + 256:
                data.append(t - FIRST_BYTE_TOKEN)
            elif t >= FIRST_BYTE_TOKEN + 256:
                data.extend(self.tokens[t].replace(SPACE, " ").encode("utf-8"))
        return data.decode("utf-8", errors="replace")


def build_vocabulary(alphabet, merges):
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    types = [TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL] + [TYPE_BYTE] * 256
    scores = [0.0] * len(tokens)
    for ch in alphabet:
        tokens.append(ch)
        types.append(TYPE_NORMAL)
        scores.append(0.0)
    for rank, merged in enumerate(merges):
        tokens.append(merged)
        types.append(TYPE_NORMAL)
        scores.append(-float(rank))
    return tokens, scores, types


def stage_tokenizer(work: str, vocab_size: int) -> None:
    path = os.path.join(work, "tokenizer.json")
    if os.path.exists(path):
        return
    started = time.time()
    with open(os.path.join(work, "corpus_train.json")) as f:
        train = json.load(f)
    with open(os.path.join(work, "corpus_valid.json")) as f:
        valid = json.load(f)
    counts = chunk_counts(text for _, text in train)
    alphabet, merges = train_bpe(counts, vocab_size)
    tokens, scores, types = build_vocabulary(alphabet, merges)
    if len(tokens) != vocab_size:
        print(f"tokenizer: {len(tokens)} tokens (fewer merges were possible than asked)")
    tokenizer = SpmTokenizer(tokens, scores)
    for split, files in (("train", train), ("valid", valid)):
        ids = []
        for _, text in files:
            ids.extend(tokenizer.encode(text))
            ids.append(EOS)
        np.asarray(ids, dtype=np.int32).tofile(os.path.join(work, f"tokens_{split}.bin"))
        print(f"tokenizer: {split} split {len(ids)} tokens", flush=True)
    with open(path, "w") as f:
        json.dump({"tokens": tokens, "scores": scores, "types": types}, f)
    print(f"tokenizer: {len(tokens)} tokens ({len(alphabet)} characters, {len(merges)} merges) "
          f"in {time.time() - started:.0f} s", flush=True)


def load_tokenizer(work: str):
    with open(os.path.join(work, "tokenizer.json")) as f:
        data = json.load(f)
    return data, SpmTokenizer(data["tokens"], data["scores"])


# --------------------------------------------------------------------------------------
# The model: llama architecture with llama.cpp's semantics
# --------------------------------------------------------------------------------------

def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary positions on adjacent pairs (x[2i], x[2i+1]) with theta_i = base^(-2i/d):
    llama.cpp's "normal" rope mode for the llama architecture. x: [B, T, H, D]."""
    dim = x.shape[-1]
    inverse = ROPE_BASE ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inverse[None, :]
    cos = torch.cos(angles).to(x.dtype)[None, :, None, :]
    sin = torch.sin(angles).to(x.dtype)[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * self.weight


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        dim, heads, kv_heads = c["dim"], c["heads"], c["kv_heads"]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w_gate = nn.Linear(dim, c["ffn"], bias=False)
        self.w_up = nn.Linear(dim, c["ffn"], bias=False)
        self.w_down = nn.Linear(c["ffn"], dim, bias=False)

    def forward(self, x, positions, mask):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(b, t, self.heads, self.head_dim), positions)
        k = rope(self.wk(h).view(b, t, self.kv_heads, self.head_dim), positions)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim)
        repeat = self.heads // self.kv_heads  # query head j reads KV head j // repeat
        k = k.repeat_interleave(repeat, dim=2)
        v = v.repeat_interleave(repeat, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
        out = scores.softmax(-1) @ v
        x = x + self.wo(out.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    def __init__(self, c: dict, vocab_size: int):
        super().__init__()
        self.config = c
        self.embedding = nn.Embedding(vocab_size, c["dim"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["dim"])
        self.output = None if c["tied"] else nn.Linear(c["dim"], vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=0.02)
        for name, p in self.named_parameters():
            if p.dim() == 2 and name != "embedding.weight":
                nn.init.normal_(p, std=0.02)
            if name.endswith("wo.weight") or name.endswith("w_down.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c["layers"]))

    def forward(self, tokens):
        t = tokens.shape[1]
        positions = torch.arange(t)
        mask = torch.full((t, t), float("-inf"), dtype=self.embedding.weight.dtype).triu(1)
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, positions, mask)
        x = self.norm(x)
        weight = self.embedding.weight if self.output is None else self.output.weight
        return x @ weight.t()


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------

def load_split(work: str, split: str) -> np.ndarray:
    return np.fromfile(os.path.join(work, f"tokens_{split}.bin"), dtype=np.int32)


def batch_at(data: np.ndarray, step: int, batch: int, context: int, seed: int):
    """Random windows of context + 1 tokens, a function of (seed, step) only."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    rows = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def validation_batches(data: np.ndarray, context: int, count: int = 24):
    starts = np.linspace(0, len(data) - context - 2, count).astype(np.int64)
    return [torch.from_numpy(data[s:s + context + 1].astype(np.int64))[None] for s in starts]


def learning_rate(step: int, c: dict) -> float:
    if step < c["warmup"]:
        return c["lr"] * (step + 1) / c["warmup"]
    progress = (step - c["warmup"]) / max(1, c["steps"] - c["warmup"])
    return c["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model, batches, teacher=None) -> tuple[float, float]:
    """Mean validation cross-entropy against the data, and against the teacher's rows."""
    model.eval()
    data_loss, teacher_loss = 0.0, 0.0
    for rows in batches:
        logits = model(rows[:, :-1])
        data_loss += F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
        if teacher is not None:
            p = teacher(rows[:, :-1]).softmax(-1)
            teacher_loss += -(p * logits.log_softmax(-1)).sum(-1).mean().item()
    model.train()
    return data_loss / len(batches), teacher_loss / len(batches)


def train_model(work: str, name: str, c: dict, vocab_size: int, teacher=None) -> Llama:
    """Trains (or resumes) one model; returns it. The draft learns the teacher's T = 1 rows
    (soft-label cross-entropy), which is what its acceptance rate depends on."""
    final = os.path.join(work, f"{name}.pt")
    model = Llama(c, vocab_size)
    if os.path.exists(final):
        model.load_state_dict(torch.load(final))
        return model
    torch.manual_seed(SEED + (0 if name == "target" else 1))
    model = Llama(c, vocab_size)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() != 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": other, "weight_decay": 0.0}],
                                  lr=c["lr"], betas=(0.9, 0.95), eps=1e-8)
    checkpoint = os.path.join(work, f"{name}.checkpoint.pt")
    log_path = os.path.join(work, f"{name}_loss.csv")
    step, elapsed = 0, 0.0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        print(f"{name}: resuming at step {step}", flush=True)
    else:
        with open(log_path, "w") as f:
            f.write("step,tokens,seconds,lr,train_loss,valid_loss,valid_teacher_loss\n")
    train = load_split(work, "train")
    valid = validation_batches(load_split(work, "valid"), c["context"])
    tokens_per_step = c["batch_tokens"]
    print(f"{name}: {parameter_count(model) / 1e6:.2f}M parameters, {c['steps']} steps of "
          f"{tokens_per_step} tokens, {len(train)} training tokens", flush=True)
    running, running_count = 0.0, 0
    while step < c["steps"]:
        started = time.time()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, c)
        # Progressive length: windows of half the context first, the full context at the end.
        context = c["context"] // 2 if step < c["short_steps"] else c["context"]
        rows = batch_at(train, step, tokens_per_step // context, context, SEED + len(name))
        logits = model(rows[:, :-1])
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        else:
            with torch.no_grad():
                p = teacher(rows[:, :-1]).softmax(-1)
            loss = -(p * logits.log_softmax(-1)).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed += time.time() - started
        running += loss.item()
        running_count += 1
        last = step == c["steps"]
        if step % 25 == 0 or last:
            valid_loss, valid_teacher = ("", "")
            if step % 100 == 0 or last:
                a, b = evaluate(model, valid, teacher)
                valid_loss, valid_teacher = f"{a:.4f}", (f"{b:.4f}" if teacher else "")
            with open(log_path, "a") as f:
                f.write(f"{step},{step * tokens_per_step},{elapsed:.1f},"
                        f"{learning_rate(step - 1, c):.6f},{running / running_count:.4f},"
                        f"{valid_loss},{valid_teacher}\n")
            print(f"{name}: step {step}/{c['steps']} loss {running / running_count:.4f} "
                  f"valid {valid_loss} {valid_teacher} "
                  f"({step * tokens_per_step / elapsed:.0f} tokens/s)", flush=True)
            running, running_count = 0.0, 0
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "elapsed": elapsed}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
    torch.save(model.state_dict(), final)
    with open(os.path.join(work, f"{name}_time.json"), "w") as f:
        json.dump({"seconds": elapsed, "steps": step}, f)
    return model


# --------------------------------------------------------------------------------------
# GGUF (version 3) writer
# --------------------------------------------------------------------------------------

GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY = 4, 5, 6, 7, 8, 9
GGML_F32, GGML_F16, GGML_I32 = 0, 1, 26
ALIGNMENT = 32


class GgufWriter:
    def __init__(self):
        self.metadata: list[tuple[str, int, object]] = []
        self.tensors: list[tuple[str, np.ndarray, int]] = []

    def add(self, key: str, kind: int, value) -> None:
        self.metadata.append((key, kind, value))

    def add_tensor(self, name: str, array: np.ndarray, ggml_type: int) -> None:
        dtype = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_I32: np.int32}[ggml_type]
        self.tensors.append((name, np.ascontiguousarray(array, dtype=dtype), ggml_type))

    @staticmethod
    def _string(s: str) -> bytes:
        data = s.encode("utf-8")
        return struct.pack("<Q", len(data)) + data

    def _value(self, kind: int, value) -> bytes:
        if kind == GGUF_UINT32:
            return struct.pack("<I", value)
        if kind == GGUF_INT32:
            return struct.pack("<i", value)
        if kind == GGUF_FLOAT32:
            return struct.pack("<f", value)
        if kind == GGUF_BOOL:
            return struct.pack("<B", 1 if value else 0)
        if kind == GGUF_STRING:
            return self._string(value)
        element_kind, items = value
        return struct.pack("<IQ", element_kind, len(items)) + b"".join(
            self._value(element_kind, item) for item in items)

    def write(self, path: str) -> None:
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata))
        for key, kind, value in self.metadata:
            out += self._string(key) + struct.pack("<I", kind) + self._value(kind, value)
        offset = 0
        offsets = []
        for name, array, ggml_type in self.tensors:
            offsets.append(offset)
            dims = list(reversed(array.shape))  # GGUF lists the fastest dimension first
            out += self._string(name) + struct.pack("<I", len(dims))
            out += b"".join(struct.pack("<Q", d) for d in dims)
            out += struct.pack("<IQ", ggml_type, offset)
            offset += array.nbytes
            offset += (-offset) % ALIGNMENT
        out += b"\0" * ((-len(out)) % ALIGNMENT)
        for (name, array, _), start in zip(self.tensors, offsets):
            out += array.tobytes()
            out += b"\0" * ((-len(out)) % ALIGNMENT)
        with open(path + ".tmp", "wb") as f:
            f.write(out)
        os.replace(path + ".tmp", path)


def tensor_map(model: Llama) -> list[tuple[str, torch.Tensor]]:
    """llama.cpp's tensor names; 2-D weights as [out, in] (GGUF dims [in, out])."""
    out = [("token_embd.weight", model.embedding.weight)]
    for i, block in enumerate(model.blocks):
        out += [
            (f"blk.{i}.attn_norm.weight", block.attn_norm.weight),
            (f"blk.{i}.attn_q.weight", block.wq.weight),
            (f"blk.{i}.attn_k.weight", block.wk.weight),
            (f"blk.{i}.attn_v.weight", block.wv.weight),
            (f"blk.{i}.attn_output.weight", block.wo.weight),
            (f"blk.{i}.ffn_norm.weight", block.ffn_norm.weight),
            (f"blk.{i}.ffn_gate.weight", block.w_gate.weight),
            (f"blk.{i}.ffn_up.weight", block.w_up.weight),
            (f"blk.{i}.ffn_down.weight", block.w_down.weight),
        ]
    out.append(("output_norm.weight", model.norm.weight))
    if model.output is not None:
        out.append(("output.weight", model.output.weight))
    return out


def round_to_f16(model: Llama) -> None:
    """The weights as the GGUF file holds them: 2-D tensors through float16."""
    with torch.no_grad():
        for _, tensor in tensor_map(model):
            if tensor.dim() == 2:
                tensor.copy_(tensor.to(torch.float16).to(torch.float32))


def write_model(path: str, name: str, model: Llama, vocab: dict, corpus: dict) -> None:
    c = model.config
    w = GgufWriter()
    w.add("general.architecture", GGUF_STRING, "llama")
    w.add("general.name", GGUF_STRING, name)
    w.add("general.file_type", GGUF_UINT32, 1)  # mostly F16
    w.add("general.license", GGUF_STRING, "MIT")
    w.add("general.description", GGUF_STRING,
          "specdec example model, trained by scripts/train_llama_pair.py on the Python 3.11 "
          "standard library sources of Debian's " +
          ", ".join(f"{k} {v}" for k, v in corpus["packages"].items()) + " (PSF licence)")
    w.add("llama.context_length", GGUF_UINT32, c["context"])
    w.add("llama.embedding_length", GGUF_UINT32, c["dim"])
    w.add("llama.block_count", GGUF_UINT32, c["layers"])
    w.add("llama.feed_forward_length", GGUF_UINT32, c["ffn"])
    w.add("llama.attention.head_count", GGUF_UINT32, c["heads"])
    w.add("llama.attention.head_count_kv", GGUF_UINT32, c["kv_heads"])
    w.add("llama.attention.layer_norm_rms_epsilon", GGUF_FLOAT32, RMS_EPS)
    w.add("llama.rope.freq_base", GGUF_FLOAT32, ROPE_BASE)
    w.add("llama.rope.dimension_count", GGUF_UINT32, c["dim"] // c["heads"])
    w.add("llama.vocab_size", GGUF_UINT32, len(vocab["tokens"]))
    w.add("tokenizer.ggml.model", GGUF_STRING, "llama")
    w.add("tokenizer.ggml.tokens", GGUF_ARRAY, (GGUF_STRING, vocab["tokens"]))
    w.add("tokenizer.ggml.scores", GGUF_ARRAY, (GGUF_FLOAT32, vocab["scores"]))
    w.add("tokenizer.ggml.token_type", GGUF_ARRAY, (GGUF_INT32, vocab["types"]))
    w.add("tokenizer.ggml.bos_token_id", GGUF_UINT32, BOS)
    w.add("tokenizer.ggml.eos_token_id", GGUF_UINT32, EOS)
    w.add("tokenizer.ggml.unknown_token_id", GGUF_UINT32, UNK)
    w.add("tokenizer.ggml.add_bos_token", GGUF_BOOL, True)
    w.add("tokenizer.ggml.add_eos_token", GGUF_BOOL, False)
    w.add("tokenizer.ggml.add_space_prefix", GGUF_BOOL, False)
    for tensor_name, tensor in tensor_map(model):
        array = tensor.detach().numpy()
        w.add_tensor(tensor_name, array, GGML_F16 if array.ndim == 2 else GGML_F32)
    w.write(path)


REFERENCE_TEXTS = [
    "def main():\n    ",
    "import os\nimport sys\n\n\nclass Path:\n    def __init__(self, name):\n        self.",
    "    return [x * 2 for x in range(10) if x % 3]  # comment\n\t\u00e9\u00e8 \u2603 caf\u00e9 "
    "\U0001F600 end",
    "",
    "   leading spaces\n\n\ntrailing   ",
]

REFERENCE_CONTEXT_LENGTHS = [1, 6, 40, 300]
REFERENCE_ROWS = 4  # logits of the last positions of each context


@torch.no_grad()
def stage_export(work: str, out: str, configs: dict) -> None:
    os.makedirs(out, exist_ok=True)
    vocab, tokenizer = load_tokenizer(work)
    with open(os.path.join(work, "corpus.json")) as f:
        corpus = json.load(f)
    vocab_size = len(vocab["tokens"])
    models = {}
    for name in ("target", "draft"):
        model = Llama(configs[name], vocab_size)
        model.load_state_dict(torch.load(os.path.join(work, f"{name}.pt")))
        model.eval()
        round_to_f16(model)
        models[name] = model
        write_model(os.path.join(out, f"{name}.gguf"), f"specdec-stdlib-{name}", model, vocab,
                    corpus)
    # Reference logits in float64 from the weights as stored (F16 -> F32 -> F64).
    valid = load_split(work, "valid")
    ref = GgufWriter()
    ref.add("general.architecture", GGUF_STRING, "specdec-reference")
    ref.add("reference.rows", GGUF_UINT32, REFERENCE_ROWS)
    ref.add("reference.context_count", GGUF_UINT32, len(REFERENCE_CONTEXT_LENGTHS))
    for i, length in enumerate(REFERENCE_CONTEXT_LENGTHS):
        length = min(length, configs["target"]["context"], configs["draft"]["context"])
        start = (1000 * i) % max(1, len(valid) - length)
        context = valid[start:start + length].astype(np.int64)
        context[0] = BOS
        ref.add_tensor(f"context.{i}", context.astype(np.int32), GGML_I32)
        for name, model in models.items():
            double = Llama(model.config, vocab_size).double()
            double.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            logits = double(torch.from_numpy(context)[None])[0, -REFERENCE_ROWS:]
            ref.add_tensor(f"{name}.logits.{i}", logits.numpy().astype(np.float32), GGML_F32)
    ref.add("reference.text_count", GGUF_UINT32, len(REFERENCE_TEXTS))
    for i, text in enumerate(REFERENCE_TEXTS):
        ref.add(f"reference.text.{i}", GGUF_STRING, text)
        ids = tokenizer.encode(text, add_bos=True)
        ref.add_tensor(f"text_ids.{i}", np.asarray(ids, dtype=np.int32), GGML_I32)
    ref.write(os.path.join(out, "reference.gguf"))
    # Loss curves and training summary.
    summary = {"corpus": corpus, "vocab_size": vocab_size}
    for name in ("target", "draft"):
        with open(os.path.join(work, f"{name}_loss.csv")) as f:
            curve = f.read()
        with open(os.path.join(out, f"{name}_loss.csv"), "w") as f:
            f.write(curve)
        with open(os.path.join(work, f"{name}_time.json")) as f:
            timing = json.load(f)
        last_valid = [line.split(",") for line in curve.strip().split("\n")[1:]
                      if line.split(",")[5]]
        summary[name] = {
            "config": configs[name],
            "parameters": parameter_count(models[name]),
            "training_seconds": round(timing["seconds"]),
            "final_train_loss": float(curve.strip().split("\n")[-1].split(",")[4]),
            "final_valid_loss": float(last_valid[-1][5]) if last_valid else None,
            "final_valid_teacher_loss": float(last_valid[-1][6]) if last_valid and
            last_valid[-1][6] else None,
        }
    sums = {}
    for file in ("target.gguf", "draft.gguf", "reference.gguf"):
        with open(os.path.join(out, file), "rb") as f:
            sums[file] = hashlib.sha256(f.read()).hexdigest()
    summary["sha256"] = sums
    summary["torch"] = torch.__version__
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for file, digest in sums.items():
            f.write(f"{digest}  {file}\n")
    print(json.dumps(summary, indent=1))


# --------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", default="all",
                        choices=["all", "corpus", "tokenizer", "target", "draft", "export"])
    parser.add_argument("--work-dir", default="build/llama-train")
    parser.add_argument("--out-dir", default="examples/llama/models")
    parser.add_argument("--quick", action="store_true", help="tiny models, for a smoke run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.work_dir, exist_ok=True)
    configs = model_configs(args.quick)
    stages = ["corpus", "tokenizer", "target", "draft", "export"]
    wanted = stages if args.stage == "all" else [args.stage]
    for stage in wanted:
        if stage == "corpus":
            stage_corpus(args.work_dir)
        elif stage == "tokenizer":
            stage_tokenizer(args.work_dir, configs["vocab_size"])
        elif stage == "target":
            train_model(args.work_dir, "target", configs["target"], configs["vocab_size"])
        elif stage == "draft":
            teacher = train_model(args.work_dir, "target", configs["target"],
                                  configs["vocab_size"])
            teacher.eval()
            for p in teacher.parameters():
                p.requires_grad_(False)
            train_model(args.work_dir, "draft", configs["draft"], configs["vocab_size"],
                        teacher)
        elif stage == "export":
            stage_export(args.work_dir, args.out_dir, configs)


if __name__ == "__main__":
    main()
