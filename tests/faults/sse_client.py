"""A streaming completions client that resumes: when its connection drops before the response is
complete, it reconnects with `Last-Event-ID` (the id of the last event it processed) until the
response ends or its deadline passes, as an SSE client (a browser's EventSource) does."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.faults.conftest import token_ids_of

__all__ = ["Streamed", "stream_completion"]


@dataclass
class Streamed:
    text: str = ""
    finish_reason: str | None = None
    speculative: dict | None = None  # the final chunk's statistics (draft and accepted tokens)
    errors: list[str] = field(default_factory=list)  # in-band errors and refused reconnections
    resumes: int = 0  # reconnections with Last-Event-ID
    last_event_id: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return token_ids_of(self.text)


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str,
    prompt_ids: list[int],
    max_tokens: int,
    deadline_s: float = 240.0,
    on_text: Callable[[Streamed], None] | None = None,
) -> Streamed:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out = Streamed()
    deadline = time.monotonic() + deadline_s
    while True:
        headers = {} if out.last_event_id is None else {"Last-Event-ID": out.last_event_id}
        try:
            async with client.stream("POST", f"{base_url}/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    if response.status_code < 500:
                        out.errors.append(f"HTTP {response.status_code}: {detail}")
                        return out
                    raise httpx.RemoteProtocolError(f"HTTP {response.status_code}: {detail}")
                event: dict[str, str] = {}
                async for line in response.aiter_lines():
                    if line:
                        name, _, value = line.partition(": ")
                        event[name] = value
                        continue
                    if _take(out, event) and on_text is not None:
                        on_text(out)
                    event = {}
        except httpx.TransportError:
            pass  # the connection dropped (a gateway died): resume below
        if out.finish_reason is not None or out.errors:
            return out
        if out.last_event_id is None:
            out.errors.append("the stream ended before its first event: nothing to resume from")
            return out
        if time.monotonic() > deadline:
            out.errors.append(f"not complete after {deadline_s} s ({out.resumes} resumes)")
            return out
        out.resumes += 1
        await asyncio.sleep(0.5)


def _take(out: Streamed, event: dict[str, str]) -> bool:
    """Apply one SSE event; True if it added text."""
    data = event.get("data")
    if data is None or data == "[DONE]":
        return False
    payload = json.loads(data)
    if "error" in payload:
        out.errors.append(payload["error"].get("message", str(payload)))
        return False
    if "id" in event:
        out.last_event_id = event["id"]
    choice = payload["choices"][0] if payload.get("choices") else {}
    out.text += choice.get("text") or ""
    out.finish_reason = choice.get("finish_reason") or out.finish_reason
    out.speculative = payload.get("speculative") or out.speculative
    return bool(choice.get("text"))
