"""The target cache: what the frozen target computes once per training sequence, on disk.

For every sequence (prompt_ids + response_ids of `dspark data generate`'s responses.jsonl) the
target is run once (a whole-sequence prefill, several sequences per varlen forward, each
request's KV freed right after) and we keep, per token:
    tokens    [T]        int32  the token ids
    captured  [T, m, d]  the outputs of the target's capture layers (the drafter's context)
    hidden    [T, d]     the final normed hidden state (the LM head's input)
p_t is never stored (O(V) per token): the trainer applies the LM head to the few `hidden` rows
it samples (`target_probs_from_hidden`), O(d) per token on disk. Two numbers per token make that
cheap with a draft vocabulary D of N << V tokens (docs/method.md §6), computed once from the
stored (rounded) `hidden` and the target's LM head W:
    logits_lse     [T]  fp32   log Σ_v exp(h·W_v), the softmax's normaliser at T = 1
    logits_argmax  [T]  int32  argmax_v h·W_v, the target's greedy token
so p_t(v) = exp(h·W_v - lse) on v in D needs N rows of W instead of V, and the mass outside D
is 1 - Σ_D p_t (`target_probs_on_vocab`); a step's vocabulary-sized passes shrink V / N times.

Storage dtype: float16 (default) or bfloat16. numpy has no bfloat16, so bf16 arrays are stored
as their raw bits in uint16 and viewed back as torch.bfloat16 on read. fp16 keeps 3 more
mantissa bits; bf16 is the safe choice for targets with activations beyond fp16's 65504
(`build_cache` refuses to write an fp16 cache that overflowed).

Layout of a cache directory:
    cache.json                      meta: format, model, capture_layers, hidden_size, dtype, shards
    shard-00000/tokens.npy          [N] int32            (N = tokens of the shard's sequences)
    shard-00000/captured.npy        [N, m, d]            fp16 / bf16-as-uint16
    shard-00000/hidden.npy          [N, d]
    shard-00000/logits_lse.npy      [N] float32   (add_logit_stats; caches built before it lack
    shard-00000/logits_argmax.npy   [N] int32      them, and `dspark cache` adds them on rerun)
    shard-00000/index.json          per sequence: id, split, prompt_len, length, offset
All arrays are .npy files opened as memory maps. The shard plan (which sequences go to which
shard) is a pure function of the ordered sequence list and `shard_tokens`, so an interrupted
run resumes by skipping shards whose index.json exists (it is written last, atomically) and
rewriting the others: the result is byte-identical to one uninterrupted run.

    dspark cache --data-dir D --out C [--split all] [--dtype float16]
    cache = TargetCache(C); cache.sequences[i].prompt_len; cache.captured(i)  # [T, m, d] memmap
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.model.target_runtime import TargetRuntime

FORMAT = "dspark-target-cache/1"
META_FILE = "cache.json"
INDEX_FILE = "index.json"
STORAGE_DTYPES = {"float16": np.float16, "bfloat16": np.uint16}  # bf16 as raw bits
SPLITS = ("train", "heldout")
LOGIT_STATS = ("logits_lse", "logits_argmax")  # per-token arrays add_logit_stats writes


# ---- input: the generated responses ------------------------------------------------------------


@dataclass(frozen=True)
class SequenceRecord:
    """One training sequence: prompt_ids + response_ids (the target's own output)."""

    id: str
    split: str  # "train" | "heldout"
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def read_responses(path: str | Path, *, split: str = "all") -> list[SequenceRecord]:
    """Records of responses.jsonl (a file, or a data directory holding one), in file order.

    Sequences without a response token are skipped (no anchor can be placed in them)."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {[*SPLITS, 'all']}, got {split!r}")
    path = Path(path)
    if path.is_dir():
        path = path / "responses.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (write it with `dspark data generate`)")
    records, seen = [], set()
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            missing = {"id", "split", "prompt_ids", "response_ids"} - obj.keys()
            if missing:
                raise ValueError(f"{path}:{line_no}: missing fields {sorted(missing)}")
            if obj["split"] not in SPLITS:
                raise ValueError(f"{path}:{line_no}: split must be one of {SPLITS}, got {obj['split']!r}")
            if obj["id"] in seen:
                raise ValueError(f"{path}:{line_no}: duplicate id {obj['id']!r}")
            seen.add(obj["id"])
            if split != "all" and obj["split"] != split:
                continue
            if not obj["response_ids"] or not obj["prompt_ids"]:
                continue
            records.append(SequenceRecord(id=str(obj["id"]), split=obj["split"],
                                          prompt_ids=tuple(obj["prompt_ids"]), response_ids=tuple(obj["response_ids"])))
    return records


# ---- the shard plan ----------------------------------------------------------------------------


def plan_shards(lengths: Sequence[int], *, shard_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequence indices, each closed once it holds >= shard_tokens tokens.

    A pure function of the lengths: the same list always gives the same shards (resume rests on it)."""
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    shards, current, tokens = [], [], 0
    for i, n in enumerate(lengths):
        current.append(i)
        tokens += n
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def bytes_per_token(*, num_layers: int, hidden_size: int, dtype: str = "float16") -> int:
    """Disk bytes per cached token: m captured layers + the final hidden, plus an int32 id."""
    itemsize = np.dtype(STORAGE_DTYPES[dtype]).itemsize
    return (num_layers + 1) * hidden_size * itemsize + 4


def _to_storage(x: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return x.to(torch.float16).cpu().numpy()
    return x.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)


def _from_storage(a: np.ndarray, dtype: str) -> torch.Tensor:
    # a memmap slice -> a torch tensor in the storage dtype (fp16 / bf16), copied out of the map
    if dtype == "float16":
        return torch.from_numpy(np.array(a, dtype=np.float16))
    return torch.from_numpy(np.array(a, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


# ---- writing -----------------------------------------------------------------------------------


@dataclass
class CacheStats:
    sequences: int  # sequences in the cache
    tokens: int  # tokens in the cache
    written_tokens: int  # tokens computed by this call (0 when everything was already cached)
    bytes_per_token: int
    seconds: float  # wall time of the target forwards and writes of this call


def _shard_dir(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}"


def _shard_complete(out: Path, i: int, ids: list[str]) -> bool:
    index = _shard_dir(out, i) / INDEX_FILE
    if not index.exists():
        return False
    entries = json.loads(index.read_text())["sequences"]
    return [e["id"] for e in entries] == ids


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_cache(
    runtime: TargetRuntime,
    records: Sequence[SequenceRecord],
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    shard_tokens: int = 1 << 16,
    batch_tokens: int = 4096,
    model_name: str = "",
    progress: bool = True,
    lm_head_weight: torch.Tensor | None = None,  # [V, d]: also write the logit stats (add_logit_stats)
    max_shards: int | None = None,  # stop after writing this many shards (tests: simulate an interruption)
    log=None,  # callable(str); default prints to stderr
) -> CacheStats:
    """Run the target over `records` and write (or complete) the cache in `out_dir`.

    Invariant: a shard directory with an index.json holds exactly its planned sequences, fully
    written and flushed; everything else is (re)computed."""
    import time

    from tqdm import tqdm

    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
    if batch_tokens <= 0:
        raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
    log = log or (lambda s: print(s, file=sys.stderr))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = runtime.config
    layers = tuple(int(l) for l in runtime.capture_layers)
    too_long = [r.id for r in records if r.length > runtime.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} sequences exceed the target's context window {runtime.max_model_len}: {too_long[:5]}")
    meta = {
        "format": FORMAT, "model": model_name, "capture_layers": list(layers), "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_layers, "dtype": dtype, "shard_tokens": shard_tokens,
    }
    meta_path = out / META_FILE
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        old_cmp = {k: old.get(k) for k in meta if k != "model"}
        if old_cmp != {k: v for k, v in meta.items() if k != "model"}:
            raise ValueError(f"{out} holds a cache with different settings {old_cmp}; use another --out")
    plan = plan_shards([r.length for r in records], shard_tokens=shard_tokens)
    meta["shards"] = len(plan)
    meta["sequences"] = len(records)
    meta["tokens"] = sum(r.length for r in records)
    bpt = bytes_per_token(num_layers=len(layers), hidden_size=cfg.hidden_size, dtype=dtype)
    todo = [i for i, idx in enumerate(plan) if not _shard_complete(out, i, [records[j].id for j in idx])]
    todo_tokens = sum(records[j].length for i in todo for j in plan[i])
    log(f"target cache: {len(records)} sequences, {meta['tokens']} tokens x {bpt} B/token = "
        f"{meta['tokens'] * bpt / 2**30:.2f} GiB in {len(plan)} shards ({dtype}); "
        f"{len(plan) - len(todo)} shards already complete, {todo_tokens * bpt / 2**30:.2f} GiB to write")
    _atomic_write(meta_path, json.dumps(meta, indent=2))
    # stale shards from a longer plan (the records changed) would be read as part of the cache
    for extra in sorted(out.glob("shard-*")):
        if extra.is_dir() and int(extra.name.split("-")[1]) >= len(plan):
            shutil.rmtree(extra)

    t0 = time.perf_counter()
    written = 0
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, desc="cache")
    for done, i in enumerate(todo):
        if max_shards is not None and done >= max_shards:
            break
        seqs = [records[j] for j in plan[i]]
        d = _shard_dir(out, i)
        if d.exists():
            shutil.rmtree(d)  # incomplete: rewrite from scratch
        d.mkdir()
        n = sum(r.length for r in seqs)
        np_dtype = STORAGE_DTYPES[dtype]
        tokens = np.lib.format.open_memmap(d / "tokens.npy", mode="w+", dtype=np.int32, shape=(n,))
        captured = np.lib.format.open_memmap(d / "captured.npy", mode="w+", dtype=np_dtype, shape=(n, len(layers), cfg.hidden_size))
        hidden = np.lib.format.open_memmap(d / "hidden.npy", mode="w+", dtype=np_dtype, shape=(n, cfg.hidden_size))
        entries, offset = [], 0
        for batch in _forward_batches(seqs, batch_tokens):
            outs = _prefill(runtime, batch)
            for r, (cap, hid) in zip(batch, outs):
                if dtype == "float16" and not (torch.isfinite(cap.half()).all() and torch.isfinite(hid.half()).all()):
                    raise ValueError(f"sequence {r.id!r}: target activations overflow float16; rebuild with --dtype bfloat16")
                sl = slice(offset, offset + r.length)
                tokens[sl] = np.asarray(r.token_ids, dtype=np.int32)
                captured[sl] = _to_storage(cap, dtype)
                hidden[sl] = _to_storage(hid, dtype)
                entries.append({"id": r.id, "split": r.split, "prompt_len": len(r.prompt_ids), "length": r.length, "offset": offset})
                offset += r.length
                bar.update(r.length)
                written += r.length
        for a in (tokens, captured, hidden):
            a.flush()
        del tokens, captured, hidden
        _atomic_write(d / INDEX_FILE, json.dumps({"sequences": entries}))  # last: marks the shard complete
    bar.close()
    if lm_head_weight is not None:
        add_logit_stats(out, lm_head_weight, progress=progress)
    return CacheStats(sequences=len(records), tokens=meta["tokens"], written_tokens=written, bytes_per_token=bpt,
                      seconds=time.perf_counter() - t0)


@torch.no_grad()
def add_logit_stats(cache_dir: str | Path, lm_head_weight: torch.Tensor, *, rows_per_pass: int = 2048,
                    progress: bool = True) -> int:
    """Write logits_lse / logits_argmax (module docstring) into every complete shard that lacks
    them; returns the number of shards written. Computed from the stored hidden rows as the
    trainer reads them (rounded to the storage dtype, then fp32 @ Wᵀ in fp32), so they describe
    exactly the p_t the trainer would otherwise compute in full. Each file is written to a
    temporary name and renamed, the argmax last: a shard with both files is complete."""
    from tqdm import tqdm

    out = Path(cache_dir)
    meta = json.loads((out / META_FILE).read_text())
    weight = lm_head_weight.detach().float()  # [V, d]
    if tuple(weight.shape) != (meta["vocab_size"], meta["hidden_size"]):
        raise ValueError(f"LM head {tuple(weight.shape)} does not match the cache's [vocab, hidden] = "
                         f"[{meta['vocab_size']}, {meta['hidden_size']}]")
    todo = [i for i in range(meta["shards"]) if (_shard_dir(out, i) / INDEX_FILE).exists()
            and not all((_shard_dir(out, i) / f"{name}.npy").exists() for name in LOGIT_STATS)]
    for i in tqdm(todo, disable=not progress or not todo, desc="logit stats", unit="shard"):
        d = _shard_dir(out, i)
        hidden = np.load(d / "hidden.npy", mmap_mode="r")  # [N, d]
        lse = np.empty(hidden.shape[0], dtype=np.float32)
        argmax = np.empty(hidden.shape[0], dtype=np.int32)
        for start in range(0, hidden.shape[0], rows_per_pass):
            h = _from_storage(hidden[start : start + rows_per_pass], meta["dtype"]).float()  # [n, d]
            logits = h @ weight.t()  # [n, V]
            lse[start : start + h.shape[0]] = torch.logsumexp(logits, dim=-1).numpy()
            argmax[start : start + h.shape[0]] = logits.argmax(dim=-1).to(torch.int32).numpy()
        for name, values in (("logits_lse", lse), ("logits_argmax", argmax)):
            tmp = d / f"{name}.tmp.npy"
            np.save(tmp, values)
            os.replace(tmp, d / f"{name}.npy")
    return len(todo)


def _forward_batches(seqs: Sequence[SequenceRecord], batch_tokens: int) -> Iterable[list[SequenceRecord]]:
    # consecutive groups of <= batch_tokens tokens (a longer sequence goes alone)
    batch, tokens = [], 0
    for r in seqs:
        if batch and tokens + r.length > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(r)
        tokens += r.length
    if batch:
        yield batch


def _prefill(runtime: TargetRuntime, batch: list[SequenceRecord]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One varlen forward over whole sequences -> per sequence (captured [T, m, d], hidden [T, d])."""
    ids = [f"cache-{r.id}" for r in batch]
    for rid, r in zip(ids, batch):
        runtime.add_request(rid, r.length)
    try:
        token_ids = torch.tensor([t for r in batch for t in r.token_ids], dtype=torch.long)
        out = runtime.forward(ids, token_ids, [r.length for r in batch],
                              logits_indices=torch.empty(0, dtype=torch.long), capture=True)
    finally:
        for rid in ids:
            runtime.free_request(rid)
    result = []
    for r, start in zip(batch, out.query_start):
        result.append((out.captured[start : start + r.length], out.hidden[start : start + r.length]))
    return result


# ---- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedSequence:
    id: str
    split: str
    prompt_len: int  # P: response tokens start at position P
    length: int  # T = prompt + response
    shard: int
    offset: int  # first row of this sequence in its shard's arrays


class TargetCache:
    """Read side: every complete shard's sequences, memory-mapped (nothing loaded up front)."""

    def __init__(self, path: str | Path, *, require_complete: bool = True):
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(f"{self.path} is not a target cache: no {META_FILE} (build it with `dspark cache`)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.dtype: str = self.meta["dtype"]
        self.capture_layers: tuple[int, ...] = tuple(self.meta["capture_layers"])
        self.hidden_size: int = self.meta["hidden_size"]
        self.sequences: list[CachedSequence] = []
        self._arrays: dict[int, dict[str, np.ndarray]] = {}
        missing = []
        for i in range(self.meta["shards"]):
            index = _shard_dir(self.path, i) / INDEX_FILE
            if not index.exists():
                missing.append(i)
                continue
            for e in json.loads(index.read_text())["sequences"]:
                self.sequences.append(CachedSequence(shard=i, **e))
        if missing and require_complete:
            raise ValueError(f"{self.path}: shards {missing[:10]} are incomplete; rerun `dspark cache` to finish them")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def indices(self, split: str = "all") -> list[int]:
        """Positions in `self.sequences` of the given split ("train" | "heldout" | "all")."""
        if split not in (*SPLITS, "all"):
            raise ValueError(f"split must be one of {[*SPLITS, 'all']}, got {split!r}")
        return [i for i, s in enumerate(self.sequences) if split == "all" or s.split == split]

    def _array(self, shard: int, name: str) -> np.ndarray:
        arrays = self._arrays.setdefault(shard, {})
        if name not in arrays:
            arrays[name] = np.load(_shard_dir(self.path, shard) / f"{name}.npy", mmap_mode="r")
        return arrays[name]

    def _rows(self, i: int, name: str, start: int, stop: int | None) -> np.ndarray:
        s = self.sequences[i]
        stop = s.length if stop is None else stop
        if not 0 <= start <= stop <= s.length:
            raise ValueError(f"sequence {s.id!r} has {s.length} tokens, asked rows [{start}, {stop})")
        return self._array(s.shard, name)[s.offset + start : s.offset + stop]

    def tokens(self, i: int) -> torch.Tensor:  # [T] int64
        return torch.from_numpy(np.array(self._rows(i, "tokens", 0, None), dtype=np.int64))

    def captured(self, i: int, *, stop: int | None = None) -> torch.Tensor:  # [stop, m, d] fp16 / bf16
        """Captured layer outputs of positions 0..stop-1 (all positions by default)."""
        return _from_storage(self._rows(i, "captured", 0, stop), self.dtype)

    def hidden(self, i: int) -> torch.Tensor:  # [T, d] fp16 / bf16 final normed hidden
        return _from_storage(self._rows(i, "hidden", 0, None), self.dtype)

    def hidden_rows(self, i: int, rows: np.ndarray) -> torch.Tensor:  # [len(rows), d]: only the rows needed
        s = self.sequences[i]
        return _from_storage(self._array(s.shard, "hidden")[s.offset + np.asarray(rows)], self.dtype)

    @functools.cached_property
    def has_logit_stats(self) -> bool:
        """Every shard holds logits_lse / logits_argmax (add_logit_stats; checked once: open the
        cache again after adding them)."""
        shards = {s.shard for s in self.sequences}
        return all((_shard_dir(self.path, i) / f"{name}.npy").exists() for i in shards for name in LOGIT_STATS)

    def logit_stats_rows(self, i: int, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(lse [len(rows)] fp32, argmax [len(rows)] int64) of sequence i's positions `rows`."""
        s = self.sequences[i]
        at = s.offset + np.asarray(rows)
        lse = torch.from_numpy(np.array(self._array(s.shard, "logits_lse")[at], dtype=np.float32))
        argmax = torch.from_numpy(np.array(self._array(s.shard, "logits_argmax")[at], dtype=np.int64))
        return lse, argmax

    def total_tokens(self, split: str = "all") -> int:
        return sum(self.sequences[i].length for i in self.indices(split))


__all__ = [
    "CacheStats", "CachedSequence", "LOGIT_STATS", "SequenceRecord", "TargetCache", "add_logit_stats", "build_cache", "bytes_per_token",
    "plan_shards", "read_responses",
]
