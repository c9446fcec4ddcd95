"""Bus messages: JSON round trips, and malformed input rejected with a ValueError naming the field."""

from __future__ import annotations

import pytest

from dspark.bus.messages import BusRequest, EventError, OutputEvent, OutputStats, is_valid_traceparent
from dspark.sampling.logprobs import TokenLogprobs
from dspark.sampling.params import SamplingParams

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_request_round_trips_through_json():
    req = BusRequest("cmpl-1", [1, 2, 3], 16, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-3),
                     stop_token_ids=frozenset({2, 0}), traceparent=TRACEPARENT, metadata={"response": {"stop": ["\n"]}})
    assert BusRequest.from_json(req.to_json()) == req


def test_event_round_trips_through_json_and_knows_its_end():
    stats = OutputStats(prompt_tokens=3, completion_tokens=5, rounds=2, mean_accepted_length=2.5, draft_tokens=6, accepted_tokens=3)
    event = OutputEvent(offset=3, token_ids=[7, 8], finish_reason="length", stats=stats)
    back = OutputEvent.from_json(event.to_json(), event_id="12-0")
    assert back.event_id == "12-0" and back.end == 5 and back.final
    assert back.token_ids == event.token_ids and back.stats == stats
    failed = OutputEvent(offset=0, token_ids=[], finish_reason="error", error=EventError("server", "boom"))
    assert OutputEvent.from_json(failed.to_json()).error == EventError("server", "boom")


def test_logprobs_round_trip_through_json_with_the_request_and_its_events():
    req = BusRequest("chatcmpl-1", [1, 2], 4, logprobs=3)
    assert BusRequest.from_json(req.to_json()).logprobs == 3
    assert BusRequest.from_json(BusRequest("r", [1], 2).to_json()).logprobs is None
    lp = TokenLogprobs([-0.25, -1.5], [[7, 1], [8, 2]], [[-0.25, -2.0], [-0.75, -1.5]])
    back = OutputEvent.from_json(OutputEvent(offset=0, token_ids=[7, 8], logprobs=lp).to_json())
    assert back.logprobs == lp
    assert OutputEvent.from_json(OutputEvent(offset=0, token_ids=[7]).to_json()).logprobs is None


def test_an_events_logprobs_have_one_entry_per_token():
    with pytest.raises(ValueError, match="one entry per token"):
        OutputEvent(offset=0, token_ids=[7, 8], logprobs=TokenLogprobs([-0.5], [[]], [[]]))


@pytest.mark.parametrize("kwargs,field", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"request_id": ""}, "request_id"),
    ({"request_id": "a/b"}, "request_id"),
    ({"request_id": "x" * 300}, "request_id"),
    ({"prompt_ids": []}, "prompt_ids"),
    ({"prompt_ids": [1, -2]}, "prompt_ids"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"traceparent": "not-a-traceparent"}, "traceparent"),
])
def test_malformed_requests_are_rejected_naming_the_field(kwargs, field):
    base = {"request_id": "r", "prompt_ids": [1], "max_new_tokens": 4}
    with pytest.raises(ValueError, match=field):
        BusRequest(**{**base, **kwargs})


@pytest.mark.parametrize("text,match", [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"request_id": "r", "prompt_ids": [1]}', "max_new_tokens"),
    ('{"request_id": "r", "prompt_ids": [1], "max_new_tokens": 2, "params": {"temperature": -1}}', "temperature"),
    ('{"request_id": "r", "prompt_ids": [1], "max_new_tokens": 2, "params": {"top_k": 2.7}}', "top_k"),
    ('{"request_id": "r", "prompt_ids": [1], "max_new_tokens": 2, "params": {"seed": "7"}}', "seed"),
    ('{"request_id": "r", "prompt_ids": [1], "max_new_tokens": 2, "params": {"seed": 18446744073709551616}}', "seed"),
])
def test_malformed_wire_requests_raise_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        BusRequest.from_json(text)


def test_an_event_has_an_error_exactly_when_it_failed():
    with pytest.raises(ValueError, match="error"):
        OutputEvent(offset=0, token_ids=[], finish_reason="error")
    with pytest.raises(ValueError, match="error"):
        OutputEvent(offset=0, token_ids=[], finish_reason="stop", error=EventError("server", "x"))
    with pytest.raises(ValueError, match="finish_reason"):
        OutputEvent(offset=0, token_ids=[], finish_reason="aborted")
    with pytest.raises(ValueError, match="kind"):
        EventError("client", "x")


def test_traceparent_validation_follows_w3c():
    assert is_valid_traceparent(TRACEPARENT)
    assert not is_valid_traceparent(TRACEPARENT.upper())
    assert not is_valid_traceparent("00-" + "0" * 32 + "-00f067aa0ba902b7-01")  # all-zero trace id
    assert not is_valid_traceparent("ff" + TRACEPARENT[2:])  # version ff is invalid


def test_stats_of_a_continuation_add_up_to_the_whole_run():
    first = OutputStats(prompt_tokens=10, completion_tokens=6, rounds=2, mean_accepted_length=2.5, draft_tokens=8, accepted_tokens=3)
    # the continuation saw the 6 published tokens as prompt
    later = OutputStats(prompt_tokens=16, completion_tokens=4, rounds=2, mean_accepted_length=1.5, draft_tokens=4, accepted_tokens=1)
    whole = first.continued_by(later, prompt_tokens=10, completion_offset=6)
    assert whole == OutputStats(prompt_tokens=10, completion_tokens=10, rounds=4, mean_accepted_length=2.0,
                                draft_tokens=12, accepted_tokens=4)
