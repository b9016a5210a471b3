"""Request parsing at the boundary: the sampling filters, stream options and the parameters
this server refuses unless they ask for nothing."""

from __future__ import annotations

import json

import pytest

from tts_service.serve.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SolveHttpRequest,
    TokenizeRequest,
    parse,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _parse(cls=ChatCompletionRequest, **fields):
    base = CHAT if cls is ChatCompletionRequest else {"prompt": "hi"}
    return parse(cls, json.dumps({**base, **fields}).encode())


def _param(cls=ChatCompletionRequest, **fields) -> str:
    with pytest.raises(ApiError) as e:
        _parse(cls, **fields)
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


def test_chat_logprobs_and_top_logprobs_follow_openai_s_rule():
    req = _parse(logprobs=True, top_logprobs=5)
    assert req.logprobs and req.top_logprobs == 5
    assert _param(top_logprobs=2) == "top_logprobs"  # only with logprobs
    assert _parse(top_logprobs=0).top_logprobs == 0  # asks for nothing
    assert _param(logprobs=True, top_logprobs=21) == "top_logprobs"
    assert _param(logprobs=1) == "logprobs"  # a bool, strictly


def test_completions_logprobs_echo_and_every_prompt_form():
    req = _parse(CompletionRequest, logprobs=0, echo=True)
    assert req.logprobs == 0 and req.echo and req.prompts() == ["hi"]
    assert _parse(CompletionRequest, prompt=["a", "b"]).prompts() == ["a", "b"]
    assert _parse(CompletionRequest, prompt=[5, 6]).prompts() == [[5, 6]]
    assert _parse(CompletionRequest, prompt=[[5], [6, 7]]).prompts() == [[5], [6, 7]]
    for bad in ([], [""], [[]], [[1], []], [1, -1], ["a", [1]], [1.5]):
        assert _param(CompletionRequest, prompt=bad).startswith("prompt"), bad
    assert _param(CompletionRequest, logprobs=21) == "logprobs"
    assert _param(CompletionRequest, logprobs=True) == "logprobs"


BASES = {ChatCompletionRequest: CHAT, CompletionRequest: {"prompt": "hi"}}
BASES[SolveHttpRequest] = {"question": "What is 7 * 6?"}
NUMERIC = [
    (cls, name)
    for cls in BASES
    for name, field in cls.model_fields.items()
    if any(t in str(field.annotation) for t in ("int", "float"))
]


@pytest.mark.parametrize("cls,name", NUMERIC, ids=[f"{c.__name__}.{n}" for c, n in NUMERIC])
@pytest.mark.parametrize("digits", ["9" * 5000, "-" + "9" * 5000, "9" * 40])
def test_an_oversized_integer_in_any_numeric_field_is_a_400_naming_it(cls, name, digits):
    """Python refuses to parse integers of more than 4,300 digits (a 500 before); 40 digits
    overflow every field's range."""
    body = json.dumps(BASES[cls])[:-1] + f', "{name}": {digits}}}'
    with pytest.raises(ApiError) as e:
        parse(cls, body.encode())
    assert e.value.status == 400 and e.value.param == name


def test_max_tokens_beyond_any_context_is_refused_before_a_model_runs():
    assert _param(max_tokens=2**22) == "max_tokens"
    assert _parse(max_tokens=4096).max_tokens == 4096


def test_what_the_current_openai_sdk_sends_for_chat_is_accepted():
    """`max_completion_tokens`, content parts, the `developer` role and a `name`, `store`,
    `metadata`, `parallel_tool_calls` and vLLM's `ignore_eos` (issue 29)."""
    req = _parse(
        messages=[
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                "name": "ops",
            },
            {"role": "user", "content": "hi", "name": "ann"},
        ],
        max_completion_tokens=7,
        store=False,
        metadata={"run": "a"},
        parallel_tool_calls=True,
        ignore_eos=True,
    )
    assert req.max_tokens == 7 and req.ignore_eos
    assert [m.template_entry() for m in req.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert _parse(max_completion_tokens=5, max_tokens=5).max_tokens == 5


def test_what_this_server_cannot_do_is_a_400_naming_the_field():
    assert _param(max_completion_tokens=5, max_tokens=6) == "max_completion_tokens"
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(ApiError) as e:
        _parse(messages=[{"role": "user", "content": image}])
    assert (
        e.value.param == "messages.0.content" and "image_url" in e.value.body()["error"]["message"]
    )
    assert _param(store=True) == "store"
    assert _param(messages=[{"role": "tool", "content": "x"}]) == "messages.0.role"


def test_unknown_fields_are_dropped_with_a_warning_unless_strict(caplog):
    body = json.dumps({**CHAT, "guided_json": {}, "foo": 1}).encode()
    with caplog.at_level("WARNING"):
        req = parse(ChatCompletionRequest, body, strict=False)
    assert req.messages[0].content == CHAT["messages"][0]["content"]
    assert "guided_json, foo" in caplog.text
    with pytest.raises(ApiError) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.param == "guided_json"
    nested = json.dumps({**CHAT, "stream_options": {"x": 1}}).encode()
    with pytest.raises(ApiError):  # only top-level fields are another server's extensions
        parse(ChatCompletionRequest, nested, strict=False)


@pytest.mark.parametrize(
    "cls,body,param",
    [
        (TokenizeRequest, {"prompt": "\ud800"}, "prompt"),
        (
            TokenizeRequest,
            {"messages": [{"role": "user", "content": "a\udfff"}]},
            "messages.0.content",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages.0.content",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content",
        ),
        (CompletionRequest, {"prompt": "x\ud800"}, "prompt"),
        (SolveHttpRequest, {"question": "\ud800"}, "question"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field_on_every_route(cls, body, param):
    """JSON's escapes carry a lone surrogate that the tokenizer cannot take (`/tokenize` was a
    500): refused at the boundary, naming the field."""
    with pytest.raises(ApiError) as e:
        parse(cls, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param
