"""The DSpark drafter behind the engine's `Drafter` contract (serving mode).

Per request it keeps a context cache: every draft layer's keys/values of the context features
of each position the target has verified (prompt + accepted tokens). The engine hands the
features over after every forward (`observe`); they are projected into the cache lazily, all
pending positions of a request in one batched call when it next drafts: a round the draft gate
skips costs no projection (~1 ms a round on a 2-core CPU, ~8% of a compact-weight decoding step).
At a round's start the cache holds positions 0..t-1 and the anchor x_0 sits at position t:
exactly the leakage rule the drafter was trained under.

A round: one parallel backbone forward over all requests' blocks, then the sequential head
samples each request's x_1..x_γ left to right with that request's own generator (so a seeded
request reproduces whatever else is in the batch), at the request's temperature (greedy
requests get a point mass on the argmax). Proposals carry the exact rows sampled from and the
STS-calibrated conditional confidences c_k = σ(l_k / T_k).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.calibration.sts import apply_temperatures
from dspark.drafters import serving_gemms
from dspark.drafters.base import Drafter, DrafterSpec, DraftProposal, DraftRequest
from dspark.drafters.dspark.checkpoint import load_checkpoint
from dspark.drafters.dspark.heads import sample_sequential
from dspark.drafters.dspark.model import DSparkDrafter
from dspark.drafters.shared import SharedWeights
from dspark.model.transformer import Transformer


class DSparkServingDrafter(Drafter):
    def __init__(
        self,
        model: DSparkDrafter,
        *,
        temperatures: torch.Tensor | None = None,  # [γ] STS temperatures of sampled requests; None = uncalibrated
        top_k: int = 0,  # truncate the drafter's rows (sparse on the wire); 0 = full softmax
        top_p: float = 1.0,
        greedy_temperatures: torch.Tensor | None = None,  # [γ] of greedy requests; None = use `temperatures`
        logits_fn=None,  # hidden [n, d] -> U [n, V]: the target's packed LM head; None = the model's own matmul
    ):
        # the model is taken over for serving: its GEMMs swapped in place for row-invariant fast ones (serving_gemms.py)
        self.model = serving_gemms.prepare_for_serving(model.eval())
        self.device: torch.device = next(model.parameters()).device  # the target's shared weights' (TargetConfig.device)
        if isinstance(model, DSparkDrafter) and serving_gemms.available(model):  # the sequential head's x W2, all rows at once
            model.head.__dict__["w2_gemm"] = serving_gemms.serving_gemm(model.head.w2.detach().t())  # x W2 = x (W2ᵀ)ᵀ
        if serving_gemms.available(model):  # each layer's context keys/values: W_K, W_V rows of its qkv weight
            for layer in model.layers:
                layer.__dict__["kv_gemm"] = serving_gemms.serving_gemm(layer.qkv_proj.weight.detach()[model.config.q_size :])
        draft_vocabulary = isinstance(model, DSparkDrafter) and model.draft_to_target is not None
        if logits_fn is None and draft_vocabulary and serving_gemms.available(model):  # its N rows of the LM head
            logits_fn = serving_gemms.serving_gemm(model.draft_lm_head().detach())
        self.logits_fn = logits_fn
        self.temperatures = temperatures
        self.greedy_temperatures = greedy_temperatures if greedy_temperatures is not None else temperatures
        self.top_k, self.top_p = top_k, top_p
        # request -> per draft layer (keys, values) [capacity, kv_heads, head_dim] of its verified positions
        self._kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lengths: dict[str, int] = {}  # positions in the cache (projected)
        self._pending: dict[str, list[torch.Tensor]] = {}  # observed, not yet projected: [num_new, m, hidden] each
        # off the CPU: each sampled request's draft stream on the device, seeded once from the
        # engine's host stream (so a seeded request still drafts the same on every run)
        self._device_generators: dict[str, torch.Generator] = {}

    @property
    def spec(self) -> DrafterSpec:
        c = self.model.config
        # the engine captures the target layers the backbone was trained on and calls observe();
        # STS-calibrated c_k come with every proposal (the prefix scheduler's input)
        return DrafterSpec(name="dspark", needs_hidden_states=True, capture_layers=c.target_layer_ids,
                           provides_confidences=True, block_size=c.block_size, draft_vocab_size=c.draft_vocab_size)

    @classmethod
    def load(cls, path: str | Path, *, target: Transformer, top_k: int = 0, top_p: float = 1.0) -> DSparkServingDrafter:
        ckpt = load_checkpoint(path, shared=SharedWeights.from_target(target), device=target.embed.weight.device)
        ckpt.drafter.config.check_target(target.config)
        # Without a draft vocabulary: the shared LM head through the target's prepacked GEMM (4x
        # faster than a plain fp32 matmul for γ rows here, and the same weight). With one, the
        # drafter's own N-row slice of it (N/V of the work), packed by __init__.
        logits_fn = target.compute_logits if ckpt.drafter.draft_to_target is None else None
        return cls(ckpt.drafter, temperatures=ckpt.temperatures, greedy_temperatures=ckpt.greedy_temperatures,
                   top_k=top_k, top_p=top_p, logits_fn=logits_fn)

    # ---- the context cache -----------------------------------------------------------------

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        """The target's captured layer outputs of newly verified positions, [num_new, m, hidden]:
        kept until the request drafts (_project_pending)."""
        self._pending.setdefault(request_id, []).append(features.to(self.device, non_blocking=True))

    @torch.no_grad()
    def _project_pending(self, request_id: str) -> None:
        """Project a request's pending features into every draft layer's context keys/values and
        append them (one call for all positions observed since it last drafted)."""
        chunks = self._pending.pop(request_id, None)
        if not chunks:
            return
        features = chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # [num_new, m, hidden]
        n = features.shape[0]
        length = self._lengths.get(request_id, 0)
        positions = torch.arange(length, length + n, device=self.device)
        new_kv = self.model.context_kv(features.unsqueeze(0).float(), positions=positions)  # per layer [1, n, kvh, d] x 2
        bufs = self._kv.get(request_id)
        if bufs is None or length + n > bufs[0][0].shape[0]:
            capacity = max(2 * (length + n), 64)
            grown = [tuple(torch.empty(capacity, *k.shape[2:], device=self.device) for _ in range(2)) for k, _ in new_kv]
            if bufs is not None:
                for (gk, gv), (k, v) in zip(grown, bufs):
                    gk[:length], gv[:length] = k[:length], v[:length]
            self._kv[request_id] = bufs = grown
        for (k_buf, v_buf), (k, v) in zip(bufs, new_kv):
            k_buf[length : length + n] = k[0]
            v_buf[length : length + n] = v[0]
        self._lengths[request_id] = length + n

    def remove_request(self, request_id: str) -> None:
        self._kv.pop(request_id, None)
        self._lengths.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._device_generators.pop(request_id, None)

    def _generator(self, request: DraftRequest) -> torch.Generator | None:
        """The generator the request's drafts are drawn with: its own on the CPU, else a device
        stream seeded from it on first use."""
        host = request.generator
        if host is None or self.device.type == "cpu":
            return host
        gen = self._device_generators.get(request.request_id)
        if gen is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=host))
            gen = self._device_generators[request.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def context_len(self, request_id: str) -> int:
        return self._lengths.get(request_id, 0) + sum(f.shape[0] for f in self._pending.get(request_id, ()))

    def _batched_context_kv(self, request_ids: list[str], lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # per layer: [rows, max_len, kv_heads, head_dim] x 2; rows padded with zeros past their own
        # length, which the leakage mask hides (every key at or after a row's anchor is masked)
        if len(request_ids) == 1:
            return [(k[: lengths[0]].unsqueeze(0), v[: lengths[0]].unsqueeze(0)) for k, v in self._kv[request_ids[0]]]
        longest = max(lengths)
        out = []
        for layer in range(len(self.model.layers)):
            k0 = self._kv[request_ids[0]][layer][0]
            keys = torch.zeros(len(request_ids), longest, *k0.shape[1:], device=self.device)
            values = torch.zeros_like(keys)
            for row, (rid, n) in enumerate(zip(request_ids, lengths)):
                k, v = self._kv[rid][layer]
                keys[row, :n], values[row, :n] = k[:n], v[:n]
            out.append((keys, values))
        return out

    # ---- one round -------------------------------------------------------------------------

    def _encode_blocks(self, requests: list[DraftRequest], active: list[int]) -> torch.Tensor:
        """One backbone forward over the blocks anchored at the last token of each of
        `requests[i] for i in active`: [n, block_len, hidden]. Each request's context cache must
        hold exactly the positions before its anchor (RuntimeError otherwise)."""
        anchors = []
        for i in active:
            req = requests[i]
            self._project_pending(req.request_id)
            t = len(req.token_ids) - 1  # the anchor's position
            if self._lengths.get(req.request_id) != t:
                raise RuntimeError(
                    f"request {req.request_id!r}: the drafter has features of {self._lengths.get(req.request_id, 0)} "
                    f"positions, the anchor sits at {t}; the engine must observe() every verified position"
                )
            anchors.append(t)
        ids = [requests[i].request_id for i in active]
        return self.model.encode_with_context_kv(
            anchor_positions=torch.tensor(anchors, device=self.device).unsqueeze(1),  # [n, 1]
            anchor_tokens=torch.tensor([requests[i].token_ids[-1] for i in active], device=self.device).unsqueeze(1),  # [n, 1]
            context_kv=self._batched_context_kv(ids, anchors),
        )[:, 0]  # [n, block_len, hidden]

    def _base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [n, k, hidden] -> U [n, k, N] through the shared LM head (its draft-vocabulary rows)
        flat = hidden.reshape(-1, hidden.shape[-1])  # [n * k, hidden]
        logits = self.logits_fn(flat) if self.logits_fn is not None else self.model.base_logits(flat)
        return logits.view(*hidden.shape[:2], -1)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = [DraftProposal.empty() for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_draft_tokens > 0]
        if not active:
            return out
        # The backbone sees the whole block (attention within it is bidirectional); the LM head and
        # the sequential head, most of a round's cost, run only as far as some request will draft.
        steps = max(requests[i].max_draft_tokens for i in active)
        hidden = self._encode_blocks(requests, active)[:, :steps]  # [n, steps, hidden]: DSpark's block is [x_0, mask × (γ-1)]
        base_logits = self._base_logits(hidden)  # [n, steps, N]
        # One sequential-head pass per group of requests that sample alike (greedy, or the same
        # temperature and truncation); inside it each request keeps its own generator and draft
        # count, and the head's GEMMs are row-invariant, so a request drafts what it would alone.
        groups: dict[tuple, list[int]] = {}
        for row, i in enumerate(active):
            groups.setdefault(self._sampling_key(requests[i].params), []).append(row)
        for (temperature, top_k, top_p), rows in groups.items():
            reqs = [requests[active[row]] for row in rows]
            counts = [r.max_draft_tokens for r in reqs]
            k = max(counts)
            sample = sample_sequential(
                base_logits=base_logits[rows, :k],
                hidden=hidden[rows, :k],
                anchor_tokens=torch.tensor([r.token_ids[-1] for r in reqs], device=self.device),
                head=self.model.head,
                confidence_head=self.model.confidence_head,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=[self._generator(r) for r in reqs],
                draft_to_target=self.model.draft_to_target,
                num_tokens=counts,
            )
            if self.device.type != "cpu":  # the engine's side is host data: one copy per group and round
                sample = sample.to("cpu")
            temps = self.greedy_temperatures if temperature == 0.0 else self.temperatures  # STS per regime
            for j, (row, req) in enumerate(zip(rows, reqs)):
                logits = sample.confidence_logits[j, : counts[j]]  # [k_r]
                conf = apply_temperatures(logits, temps[: counts[j]]) if temps is not None else torch.sigmoid(logits)
                out[active[row]] = sample.proposal(j, num_tokens=counts[j], confidences=conf)
        return out

    def _sampling_key(self, params) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) the head samples a request's drafts with: the tighter of the
        drafter's own truncation and the request's (a token outside the request's nucleus would be
        rejected anyway, p_t = 0 there, so it is not drafted); greedy requests ignore truncation."""
        if params.is_greedy:
            return (0.0, 0, 1.0)
        return (float(params.temperature), _tighter_top_k(self.top_k, params.top_k), min(self.top_p, params.top_p))


def _tighter_top_k(a: int, b: int) -> int:
    # 0 disables a top-k filter: the tighter of two is the smaller positive one
    return min(k for k in (a, b) if k > 0) if (a > 0 or b > 0) else 0
