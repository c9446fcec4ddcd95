"""GET /metrics on the embedded gateway (tiny random model, n-gram drafter, in-memory bus).

Specification: /metrics answers Prometheus text without an API key (scrapers carry none) while
the API itself requires one; after a completion the gateway's HTTP counter for that route and
status, and the engine's counters (same process, same registry) have moved by what the
response reports: generated tokens, drafts, accepted tokens (also per position), one time to
first token, rounds; a refused request is counted under its status; the bus queue depth is read.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.drafters.ngram import NgramDrafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.speculative import SpeculativeEngine
from gateway.server import embedded_gateway
from tests.conftest import make_tiny_runtime
from tests.gateway.conftest import ByteTokenizer, live_server

MODEL = "tiny-random"
KEY = "test-key"


@pytest.fixture(scope="module")
def gateway_url():
    engine = AsyncEngine(SpeculativeEngine(make_tiny_runtime(), NgramDrafter(), num_speculative_tokens=3)).start()
    gateway = embedded_gateway(engine, ByteTokenizer(), model_name=MODEL, api_keys=(KEY,))
    try:
        with live_server(gateway.app) as url:
            yield url
    finally:
        gateway.close()
        engine.shutdown()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, without an API key."""
    reply = httpx.get(f"{url}/metrics", timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_are_open_and_move_after_a_completion(gateway_url):
    before = scrape(gateway_url)
    body = {"model": MODEL, "prompt": "abcabcabcabcabc", "max_tokens": 20, "temperature": 0}
    assert httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=120).status_code == 401  # the API needs a key
    reply = httpx.post(f"{gateway_url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    assert reply.status_code == 200, reply.text
    after = scrape(gateway_url)
    speculative, usage = reply.json()["speculative"], reply.json()["usage"]

    route = {"method": "POST", "route": "/v1/completions"}
    assert delta(after, before, "dspark_http_requests_total", **route, status="200") == 1
    assert delta(after, before, "dspark_http_requests_total", **route, status="401") == 1
    assert delta(after, before, "dspark_http_request_duration_seconds_count", **route) == 2
    assert delta(after, before, "dspark_generation_tokens_total") == usage["completion_tokens"] == 20
    assert delta(after, before, "dspark_prompt_tokens_total") == usage["prompt_tokens"]
    drafted, accepted = delta(after, before, "dspark_draft_tokens_total"), delta(after, before, "dspark_accepted_tokens_total")
    assert drafted > 0 and accepted <= drafted
    per_position = [delta(after, before, "dspark_accepted_tokens_per_position_total", position=str(p)) for p in (1, 2, 3)]
    assert sum(per_position) == accepted
    assert delta(after, before, "dspark_rounds_total") >= speculative["rounds"] + 1  # its decode rounds and its prefill
    assert delta(after, before, "dspark_time_to_first_token_seconds_count") == 1
    assert delta(after, before, "dspark_e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "dspark_requests_finished_total", reason="length") == 1
    assert after[("dspark_bus_queue_depth", ())] == 0
    assert after[("dspark_running_requests", ())] == 0


def test_a_path_the_app_does_not_serve_is_counted_under_other(gateway_url):
    before = scrape(gateway_url)
    assert httpx.get(f"{gateway_url}/no/such/path", headers={"authorization": f"Bearer {KEY}"}, timeout=30).status_code == 404
    after = scrape(gateway_url)
    assert delta(after, before, "dspark_http_requests_total", method="GET", route="other", status="404") == 1
    assert not any("/no/such/path" in str(labels) for _, labels in after)
