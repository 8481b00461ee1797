"""OpenAI request bodies mapped onto tandem's gRPC request (router/openai_requests.py): every field a body sets
lands in its gRPC field, and the ones it leaves out stay unset for the server's defaults."""

from __future__ import annotations

import pytest

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError
from tandem.router.openai_requests import chat_request, completion_requests

USER = [{"role": "user", "content": "Hi"}]
OPTIONAL_SAMPLING = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence]


def _chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})


def _completion(**fields) -> CompletionRequest:
    return parse_body(CompletionRequest, {"model": "m", "prompt": "Once", **fields})


def test_every_chat_field_lands_in_its_grpc_field():
    body = _chat(n=2, max_tokens=10, max_completion_tokens=20, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                 repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25, seed=7, stop=["\n", "END"],
                 logprobs=True, top_logprobs=3, ignore_eos=True, stop_token_ids=[2, 3], priority=-1,
                 session_id="conv-9", user="alice", stream=True, stream_options={"include_usage": True},
                 response_format={"type": "json_object"}, speculative_tokens=2)
    assert body.user == "alice"
    r = chat_request(body, "req-1")
    assert (r.request_id, r.model, r.priority, r.session_id) == ("req-1", "m", -1, "conv-9")
    assert [(m.role, m.content) for m in r.chat.messages] == [("user", "Hi")]
    s = r.sampling
    assert (s.n, s.max_tokens, s.top_k, s.seed, s.logprobs, s.speculative_tokens) == (2, 20, 40, 7, 3, 2)
    assert (s.temperature, s.top_p, s.min_p) == pytest.approx((0.7, 0.9, 0.05))
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx((1.1, 0.5, 0.25))
    assert s.ignore_eos and list(s.stop) == ["\n", "END"] and list(s.stop_token_ids) == [2, 3]
    assert s.structured == pb.StructuredOutput(json_object=True)
    assert all(s.HasField(name) for name in OPTIONAL_SAMPLING)


def test_unset_chat_fields_stay_unset():
    r = chat_request(_chat(), "req-1")
    assert [name for name in OPTIONAL_SAMPLING if r.sampling.HasField(name)] == []
    assert not r.sampling.ignore_eos and not r.sampling.stop and not r.sampling.stop_token_ids
    assert (r.priority, r.session_id, r.WhichOneof("prompt")) == (0, "", "chat")


def test_chat_token_limits_and_logprobs():
    assert chat_request(_chat(max_tokens=10), "r").sampling.max_tokens == 10
    assert chat_request(_chat(max_completion_tokens=5, max_tokens=10), "r").sampling.max_tokens == 5
    assert chat_request(_chat(logprobs=True), "r").sampling.logprobs == 0
    assert not chat_request(_chat(logprobs=False), "r").sampling.HasField("logprobs")
    assert list(chat_request(_chat(stop="END"), "r").sampling.stop) == ["END"]


def test_completion_fields_land_in_their_grpc_fields():
    [r] = completion_requests(_completion(max_tokens=8, logprobs=2, temperature=0.0, seed=3, stop="\n",
                                          priority=4, session_id="s"), "cmpl-1")
    assert (r.request_id, r.text, r.priority, r.session_id) == ("cmpl-1", "Once", 4, "s")
    assert (r.sampling.max_tokens, r.sampling.logprobs, r.sampling.seed, list(r.sampling.stop)) == (8, 2, 3, ["\n"])
    assert r.sampling.HasField("temperature") and r.sampling.temperature == 0.0
    assert not r.sampling.HasField("n") and not r.sampling.HasField("top_p")
    [r] = completion_requests(_completion(logprobs=0), "cmpl-1")
    assert r.sampling.HasField("logprobs") and r.sampling.logprobs == 0


@pytest.mark.parametrize("prompt, expected", [
    ("Once", [("cmpl", "text", "Once")]),
    ([5, 6, 7], [("cmpl", "token_ids", [5, 6, 7])]),
    (["Only"], [("cmpl", "text", "Only")]),
    (["A", "B", "C"], [("cmpl-0", "text", "A"), ("cmpl-1", "text", "B"), ("cmpl-2", "text", "C")]),
    ([[1, 2], [3]], [("cmpl-0", "token_ids", [1, 2]), ("cmpl-1", "token_ids", [3])]),
])
def test_a_batched_prompt_makes_one_request_per_prompt(prompt, expected):
    requests = completion_requests(_completion(prompt=prompt, n=2, max_tokens=4), "cmpl")
    got = [(r.request_id, r.WhichOneof("prompt"),
            r.text if r.WhichOneof("prompt") == "text" else list(r.token_ids.ids)) for r in requests]
    assert got == expected
    assert all(r.sampling.n == 2 and r.sampling.max_tokens == 4 for r in requests)


def test_text_protobuf_cannot_encode_is_a_400():
    with pytest.raises(OpenAIError) as e:
        chat_request(_chat(messages=[{"role": "user", "content": "bad \ud800"}]), "r")
    assert e.value.status == 400 and "UTF-8" in e.value.message
    with pytest.raises(OpenAIError):
        completion_requests(_completion(prompt=["ok", "\udfff"]), "r")
