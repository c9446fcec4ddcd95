"""The EAGLE-3 drafter behind the engine's `Drafter` contract (serving mode).

Per request it keeps
  * the fused target features g_0..g_{n-1} of the verified positions (`observe`: fc applied
    once per position as the engine hands the captured layers over), and
  * its own small KV cache: the decoder layer's keys/values of the committed entries 0..e-1,
    entry p = [embed(x_p) ; g_{p-1}] (verified tokens with target features, never rolled back).
A round for anchor x_0 at position t (the cache holds g_0..g_{t-1}):
  1. catch up: one causal step over the entries e..t (the tokens accepted last round, and the
     anchor), attending to the cached 0..e-1; commit them (e = t + 1); o_t -> x_1;
  2. steps j = 2..γ: one entry [embed(x_{j-1}) ; o_{t+j-2}] per request, attending to the
     committed entries and the round's own chain (discarded after the round) -> x_j.
Requests are batched (padded keys, masked) and every draw uses the request's own generator and
temperature; each token is drawn from its own softmax (argmax at T = 0) and the proposal
carries those very rows. No confidences (EAGLE-3 has no confidence head).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest
from dspark.drafters import serving_gemms
from dspark.drafters.eagle3.checkpoint import load_checkpoint
from dspark.drafters.eagle3.model import Eagle3Drafter
from dspark.drafters.shared import SharedWeights, draw_tokens, is_truncated, to_proposal
from dspark.model.transformer import Transformer


def _grown(buf: torch.Tensor | None, used: int, need: int, row_shape: tuple[int, ...]) -> torch.Tensor:
    # a [capacity, *row_shape] buffer holding at least `need` rows, the first `used` kept
    if buf is not None and need <= buf.shape[0]:
        return buf
    new = torch.empty(max(2 * need, 64), *row_shape)
    if buf is not None:
        new[:used] = buf[:used]
    return new


class Eagle3ServingDrafter(Drafter):
    def __init__(
        self,
        model: Eagle3Drafter,
        *,
        top_k: int = 0,  # truncate the drafter's rows (sparse on the wire); 0 = full softmax
        top_p: float = 1.0,
        logits_fn=None,  # normed hidden [n, d] -> [n, V]: the target's packed LM head; None = a plain matmul
    ):
        self.model = serving_gemms.prepare_for_serving(model.eval())  # its GEMMs prepacked in place
        self.logits_fn = logits_fn
        self.top_k, self.top_p = top_k, top_p
        self._features: dict[str, torch.Tensor] = {}  # request -> [capacity, hidden] g_0..g_{n-1}
        self._num_features: dict[str, int] = {}
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> [capacity, kvh, head_dim] x 2
        self._num_entries: dict[str, int] = {}

    @property
    def spec(self) -> DrafterSpec:
        c = self.model.config
        return DrafterSpec(name="eagle3", needs_hidden_states=True, capture_layers=c.target_layer_ids, block_size=c.block_size)

    @classmethod
    def load(cls, path: str | Path, *, target: Transformer, top_k: int = 0, top_p: float = 1.0) -> Eagle3ServingDrafter:
        if target.embed.weight.device.type != "cpu":
            raise ValueError(f"the EAGLE-3 serving drafter runs on the CPU only for now; the target is on "
                             f"{target.embed.weight.device} (use --drafter dspark or dflash there, or model.device cpu)")
        model = load_checkpoint(path, shared=SharedWeights.from_target(target))
        model.config.check_target(target.config)
        return cls(model, top_k=top_k, top_p=top_p, logits_fn=target.compute_logits)

    # ---- per-request state -----------------------------------------------------------------

    @torch.no_grad()
    def observe(self, request_id: str, features: torch.Tensor) -> None:
        """Fuse and append the target's captured layer outputs of newly verified positions.
        features: [num_new, m, hidden]."""
        n = features.shape[0]
        used = self._num_features.get(request_id, 0)
        fused = self.model.fuse(features.float())  # [num_new, hidden]
        buf = _grown(self._features.get(request_id), used, used + n, (fused.shape[-1],))
        buf[used : used + n] = fused
        self._features[request_id] = buf
        self._num_features[request_id] = used + n

    def remove_request(self, request_id: str) -> None:
        for state in (self._features, self._num_features, self._kv, self._num_entries):
            state.pop(request_id, None)

    def context_len(self, request_id: str) -> int:
        """Verified positions whose features the drafter holds."""
        return self._num_features.get(request_id, 0)

    def num_entries(self, request_id: str) -> int:
        """Committed entries in the request's KV cache (positions 0..anchor of its last round)."""
        return self._num_entries.get(request_id, 0)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        # out: [n, hidden] o_p -> [n, V] fp32
        if self.logits_fn is None:
            return self.model.logits(out)
        return self.logits_fn(self.model.final_hidden(out))

    # ---- one round -------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = [DraftProposal.empty() for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_draft_tokens > 0]
        if not active:
            return out
        reqs = [requests[i] for i in active]
        anchors, starts = [], []
        for req in reqs:
            t = len(req.token_ids) - 1  # the anchor's position
            if self._num_features.get(req.request_id, 0) != t:
                raise RuntimeError(
                    f"request {req.request_id!r}: the drafter has features of {self._num_features.get(req.request_id, 0)} "
                    f"positions, the anchor sits at {t}; the engine must observe() every verified position"
                )
            anchors.append(t)
            # entries 0..t depend on verified tokens and features only: a repeated round at the same
            # anchor recomputes entry t (its o_t is not kept) and overwrites it with the same values
            starts.append(min(self._num_entries.get(req.request_id, 0), t))
        o_anchor = self._catch_up(reqs, anchors, starts)  # [R, hidden] o_t
        for i, proposal in zip(active, self._draft_chains(reqs, anchors, o_anchor)):
            out[i] = proposal
        return out

    def _catch_up(self, reqs: list[DraftRequest], anchors: list[int], starts: list[int]) -> torch.Tensor:
        """Step 1: entries starts[r]..anchors[r] of every request in one padded causal forward,
        committed to the requests' caches; returns o at each anchor [R, hidden]."""
        c = self.model.config
        rows = len(reqs)
        counts = [t - s + 1 for t, s in zip(anchors, starts)]  # new entries per request (>= 1)
        width, prefix = max(counts), max(starts)
        tokens = torch.zeros(rows, width, dtype=torch.long)
        features = torch.zeros(rows, width, c.hidden_size)
        positions = torch.zeros(rows, width, dtype=torch.long)
        keys = torch.zeros(rows, prefix, c.num_kv_heads, c.head_dim)
        values = torch.zeros_like(keys)
        mask = torch.zeros(rows, 1, width, prefix + width, dtype=torch.bool)
        causal = torch.ones(width, width, dtype=torch.bool).tril()  # [C, C]
        first_key = self.model.first_key_entry  # 1: entry 0 is no other entry's key (entry_layout "feature")
        for r, (req, s, n) in enumerate(zip(reqs, starts, counts)):
            rid = req.request_id
            tokens[r, :n] = torch.tensor(req.token_ids[s : s + n])
            # entry p reads g_{p-1}: rows s-1..t-1 of the feature cache (entry 0 reads g_{-1} = 0)
            lo, first = max(s - 1, 0), 1 if s == 0 else 0
            if s + n - 1 > lo:
                features[r, first:n] = self._features[rid][lo : s + n - 1]
            positions[r] = s + torch.arange(width)
            if s:
                keys[r, :s], values[r, :s] = self._kv[rid][0][:s], self._kv[rid][1][:s]
            mask[r, 0, :, :s] = True
            mask[r, 0, :, prefix : prefix + width] = causal & (torch.arange(width) < n)  # padded entries are never keys
            if first_key and s == 0:  # entry_layout "feature": the featureless entry 0 attends to itself only
                mask[r, 0, 1:, prefix] = False
            elif first_key:
                mask[r, 0, :, 0] = False
        o, (k_new, v_new) = self.model.step(tokens=tokens, features=features, positions=positions,
                                            prefix_kv=(keys, values), mask=mask)
        for r, (req, s, n) in enumerate(zip(reqs, starts, counts)):
            rid = req.request_id
            kbuf, vbuf = self._kv.get(rid, (None, None))
            kbuf = _grown(kbuf, s, s + n, tuple(k_new.shape[2:]))
            vbuf = _grown(vbuf, s, s + n, tuple(v_new.shape[2:]))
            kbuf[s : s + n], vbuf[s : s + n] = k_new[r, :n], v_new[r, :n]
            self._kv[rid] = (kbuf, vbuf)
            self._num_entries[rid] = s + n
        return o[torch.arange(rows), torch.tensor(counts) - 1]

    def _draft_chains(
        self,
        reqs: list[DraftRequest],
        anchors: list[int],
        o_anchor: torch.Tensor,  # [R, hidden] o_t of each request's anchor
    ) -> list[DraftProposal]:
        """Steps 1..γ: draw x_1 from o_t, then feed [embed(x_{j-1}) ; o] back one entry at a time."""
        c = self.model.config
        rows = len(reqs)
        committed = [t + 1 for t in anchors]
        longest = max(committed)
        keys = torch.zeros(rows, longest, c.num_kv_heads, c.head_dim)
        values = torch.zeros_like(keys)
        committed_ok = torch.zeros(rows, longest, dtype=torch.bool)
        for r, (req, n) in enumerate(zip(reqs, committed)):
            k, v = self._kv[req.request_id]
            keys[r, :n], values[r, :n] = k[:n], v[:n]
            committed_ok[r, self.model.first_key_entry : n] = True  # entry_layout "feature": entry 0 is never a key
        gamma = max(req.max_draft_tokens for req in reqs)
        vocab = self.model.config.vocab_size
        drawn: list[list[torch.Tensor]] = [[] for _ in reqs]  # per request: tokens [1] per step
        rows_drawn: list[list[torch.Tensor | None]] = [[] for _ in reqs]  # per request: probs [1, V] or None
        o = o_anchor  # [R, hidden]
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        prev = torch.empty(rows, dtype=torch.long)
        # A Python loop over γ steps: x_j's entry needs the x_{j-1} just drawn (autoregressive drafting).
        for j in range(1, gamma + 1):
            if j > 1:
                prefix = (torch.cat([keys, *chain_k], dim=1), torch.cat([values, *chain_v], dim=1))
                mask = torch.cat([committed_ok, torch.ones(rows, j - 1, dtype=torch.bool)], dim=1).view(rows, 1, 1, -1)
                step_out, (k, v) = self.model.step(tokens=prev.unsqueeze(1), features=o.unsqueeze(1),
                                                   positions=torch.tensor(anchors).unsqueeze(1) + (j - 1),
                                                   prefix_kv=prefix, mask=mask)
                chain_k.append(k)
                chain_v.append(v)
                o = step_out[:, 0]
            logits = self._logits(o)  # [R, V]
            for r, req in enumerate(reqs):
                if j > req.max_draft_tokens:  # this request's draft is complete; its chain runs on unused
                    continue
                token, probs = draw_tokens(logits[r : r + 1], temperature=req.params.temperature, top_k=self.top_k,
                                           top_p=self.top_p, generator=req.generator)
                drawn[r].append(token)
                rows_drawn[r].append(probs)
                prev[r] = token[0]
        proposals = []
        for r, req in enumerate(reqs):
            tokens = torch.cat(drawn[r])  # [k]
            probs = None if req.params.temperature == 0.0 else torch.cat(rows_drawn[r])  # [k, V]
            truncated = is_truncated(temperature=req.params.temperature, top_k=self.top_k, top_p=self.top_p, vocab_size=vocab)
            proposals.append(to_proposal(tokens, probs, truncated=truncated))
        return proposals


__all__ = ["Eagle3ServingDrafter"]
