"""Request parsing at the boundary: the sampling filters, stream options and the parameters
this server refuses unless they ask for nothing."""

from __future__ import annotations

import json

import pytest

from tts_service.serve.api import ApiError, ChatCompletionRequest, CompletionRequest, parse

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _parse(cls=ChatCompletionRequest, **fields):
    base = CHAT if cls is ChatCompletionRequest else {"prompt": "hi"}
    return parse(cls, json.dumps({**base, **fields}).encode())


def _param(**fields) -> str:
    with pytest.raises(ApiError) as e:
        _parse(**fields)
    assert e.value.status == 400
    return e.value.param


def test_top_k_and_min_p_are_parsed_with_vllm_s_conventions():
    req = _parse(top_k=-1, min_p=0.05)
    assert (req.top_k, req.min_p) == (-1, 0.05)
    assert (_parse().top_k, _parse().min_p) == (0, 0.0)  # no filter unless asked
    assert _param(top_k=-2) == "top_k" and _param(min_p=1.5) == "min_p"


def test_stream_options_need_a_stream_and_know_only_include_usage():
    req = _parse(stream=True, stream_options={"include_usage": True})
    assert req.stream_options.include_usage
    assert _param(stream_options={"include_usage": True}) == "stream_options"
    assert _param(stream=True, stream_options={"x": 1}) == "stream_options.x"


@pytest.mark.parametrize("field,value", [("logprobs", True), ("top_logprobs", 2)])
def test_log_probabilities_are_refused_naming_the_field(field, value):
    assert _param(**{field: value}) == field


@pytest.mark.parametrize(
    "field,value", [("logprobs", False), ("logprobs", None), ("top_logprobs", 0)]
)
def test_log_probabilities_not_asked_for_are_no_ops(field, value):
    assert _parse(**{field: value}).n == 1


def test_legacy_completions_logprobs_0_asks_for_the_sampled_token_s_and_is_refused():
    with pytest.raises(ApiError) as e:
        _parse(CompletionRequest, logprobs=0)
    assert e.value.param == "logprobs"
