"""The server's Prometheus /metrics, read around a load point for the verifier batch size.

The load generator scrapes /metrics before and after a point. The verifier batch size (tokens
per verification forward, B = Σ_r (1 + ℓ_r) of Algorithm 1) is then, for a histogram or summary
`<name>_sum` / `<name>_count`, the mean over the point's forwards: Δsum / Δcount; for a gauge,
its value after the point. Which metric: `--batch-metric NAME`, or the first name containing
both "verif" and "batch" (ours: `dspark_verify_batch_tokens`). A server without /metrics (404)
gives None and the column stays empty.
"""

from __future__ import annotations

import math

import httpx

Samples = dict[str, float]  # metric name (labels summed over) -> value

_SUFFIXES = ("_sum", "_count", "_bucket", "_created", "_total")


def _split_sample(line: str) -> tuple[str, str] | None:
    """(metric name, value text) of one exposition line `name{labels} value [timestamp]`."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name, i, quoted = line[:brace], brace + 1, False
        while i < len(line):  # the closing brace outside quoted label values
            c = line[i]
            if c == "\\" and quoted:
                i += 2
                continue
            if c == '"':
                quoted = not quoted
            elif c == "}" and not quoted:
                break
            i += 1
        rest = line[i + 1:].split()
    else:
        name, *rest = line.split()
    return (name, rest[0]) if name and rest else None


def parse_prometheus(text: str) -> Samples:
    """Prometheus text exposition -> {name: value}, samples of one name summed over their labels
    (the series of all replicas or label values together); comments and malformed lines skipped."""
    out: Samples = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _split_sample(line)
        if sample is None:
            continue
        try:
            value = float(sample[1])
        except ValueError:
            continue
        if math.isfinite(value):
            out[sample[0]] = out.get(sample[0], 0.0) + value
    return out


def _is_batch_metric(name: str) -> bool:
    lower = name.lower()
    return "verif" in lower and "batch" in lower


def verifier_batch_tokens(before: Samples | None, after: Samples | None, *, metric: str | None = None) -> float | None:
    """Mean verifier batch size over the point, from /metrics before and after it; None when
    the server exposes no such metric (or nothing was verified in between)."""
    if after is None:
        return None
    before = before or {}
    bases = [metric] if metric else sorted({n.removesuffix("_sum") for n in after if n.endswith("_sum") and _is_batch_metric(n)})
    for base in bases:
        if f"{base}_sum" in after and f"{base}_count" in after:
            count = after[f"{base}_count"] - before.get(f"{base}_count", 0.0)
            if count > 0:
                return (after[f"{base}_sum"] - before.get(f"{base}_sum", 0.0)) / count
            return None
    gauges = [metric] if metric else sorted(n for n in after if _is_batch_metric(n) and not n.endswith(_SUFFIXES))
    for name in gauges:
        if name in after:
            return after[name]
    return None


async def fetch_metrics(client: httpx.AsyncClient) -> Samples | None:
    """GET /metrics on the client's base URL; None if the server has none (or it is not Prometheus text)."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or "json" in r.headers.get("content-type", ""):
        return None
    return parse_prometheus(r.text)
