"""Log-probabilities, echo and prompt lists through a replica's engine (`ServeEngine`, no
Serve): the numbers are the target's, whatever the speculative method, in OpenAI's shapes."""

from __future__ import annotations

import json
import threading

import pytest

from tts_service.engine.scoring import score_tokens
from tts_service.schemas import ServeConfig
from tts_service.serve.api import ApiError, ChatCompletionRequest, CompletionRequest, parse

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from tts_service.serve.engine import ServeEngine

    cfg = ServeConfig(
        model={"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
        served_model_name="tiny",
        max_tokens_cap=64,
        drafters={"stand": {"tree": "stand-80", "num_nodes": 8}},
    )
    eng = ServeEngine(cfg)
    yield eng
    eng.close()


def complete(engine, cls, body: dict) -> dict:
    return engine.complete(engine.prepare(parse(cls, json.dumps(body).encode())), threading.Event())


@pytest.mark.parametrize("method", ["stand", "stand-dyn", "pld"])
def test_chat_logprobs_are_the_same_with_speculation_as_without(engine, method):
    body = {**CHAT, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    plain = complete(engine, ChatCompletionRequest, {**body, "spec_method": "plain"})
    spec = complete(engine, ChatCompletionRequest, {**body, "spec_method": method})
    (p,), (s,) = plain["choices"], spec["choices"]
    assert s["message"]["content"] == p["message"]["content"]  # greedy: the same tokens
    pc, sc = p["logprobs"]["content"], s["logprobs"]["content"]
    assert len(pc) == len(sc) == plain["usage"]["completion_tokens"]
    for a, b in zip(pc, sc, strict=True):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 1e-5
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert a["bytes"] == list(a["token"].encode())
        # greedy decoding chose the most likely token: it heads the alternatives
        assert len(a["top_logprobs"]) == 3 and a["top_logprobs"][0]["logprob"] == a["logprob"]


def test_lm_eval_s_loglikelihood_request_scores_the_prompt(engine):
    """What lm-eval's `local-completions` sends for a loglikelihood task (a batch of token id
    prompts, max_tokens 1, logprobs 1, echo), read the way it reads it."""
    tok = engine.generator.loaded.tokenizer
    context, continuations = "Question: 2 + 2 =", [" 4", " five"]
    ctx = tok(context)["input_ids"]
    prompts = [ctx + tok(c, add_special_tokens=False)["input_ids"] for c in continuations]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    out = complete(engine, CompletionRequest, body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    model = engine.generator.loaded.model
    for choice, ids in zip(out["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        loglikelihood = sum(lp["token_logprobs"][len(ctx) : -1])  # lm-eval's parse_logprobs
        ref = score_tokens(model, ids, len(ctx), 0).logprobs
        assert loglikelihood == pytest.approx(sum(ref), abs=1e-4)
        scored, tops = lp["token_logprobs"][len(ctx) : -1], lp["top_logprobs"][len(ctx) : -1]
        is_greedy = all(t == max(top.values()) for t, top in zip(scored, tops, strict=True))
        ref_top = score_tokens(model, ids, len(ctx), 1).top_ids
        assert is_greedy == all(
            top[0] == t for top, t in zip(ref_top, ids[len(ctx) :], strict=True)
        )
        for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
            assert token in top and 1 <= len(top) <= 2  # the chosen token, and the top 1
        assert choice["text"].startswith(tok.decode(ids))  # echo: the prompt comes first
        assert lp["text_offset"] == sorted(lp["text_offset"])


def test_every_prompt_gets_n_choices_in_prompt_order(engine):
    body = {"prompt": ["2 + 2 =", "The sky is"], "n": 2, "max_tokens": 6, "temperature": 0}
    out = complete(engine, CompletionRequest, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    alone = [
        complete(engine, CompletionRequest, {**body, "prompt": p, "n": 1})["choices"][0]["text"]
        for p in body["prompt"]
    ]
    assert [c["text"] for c in out["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    tok = engine.generator.loaded.tokenizer
    prompt_tokens = sum(len(tok(p)["input_ids"]) for p in body["prompt"])
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert len(out["tts"]["trajectories"]) == 4


def test_echo_without_logprobs_returns_the_prompt_then_the_text(engine):
    body = {"prompt": "2 + 2 =", "max_tokens": 4, "temperature": 0}
    plain = complete(engine, CompletionRequest, body)["choices"][0]
    echoed = complete(engine, CompletionRequest, {**body, "echo": True})["choices"][0]
    assert echoed["text"] == "2 + 2 =" + plain["text"] and echoed["logprobs"] is None


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": [[1, 2], [3]], "stream": True}, "prompt"),
        ({"prompt": ["a", "b"], "aggregate": "majority"}, "aggregate"),
        ({"prompt": "a", "logprobs": 1, "stream": True}, "logprobs"),
        ({"prompt": [1, 10**8]}, "prompt"),
        ({"prompt": ["a"] * 9, "n": 8}, "prompt"),  # 72 choices > max_n
    ],
)
def test_what_cannot_be_combined_is_a_400_naming_the_field(engine, body, field):
    with pytest.raises(ApiError) as e:
        engine.prepare(parse(CompletionRequest, json.dumps({**body, "max_tokens": 4}).encode()))
    assert e.value.status == 400 and e.value.param == field


def test_vllm_s_tokenizer_routes_round_trip(engine):
    from tts_service.serve.api import DetokenizeRequest, TokenizeRequest

    def req(cls, body):
        return parse(cls, json.dumps(body).encode())

    tok = engine.generator.loaded.tokenizer
    out = engine.tokenize(req(TokenizeRequest, {"prompt": "2 + 2 =", "add_special_tokens": False}))
    assert out["tokens"] == tok("2 + 2 =", add_special_tokens=False)["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    back = engine.detokenize(req(DetokenizeRequest, {"tokens": out["tokens"]}))
    assert back == {"prompt": "2 + 2 ="}
    chat = engine.tokenize(req(TokenizeRequest, {"messages": CHAT["messages"]}))
    job = engine.prepare(parse(ChatCompletionRequest, json.dumps(CHAT).encode()))
    assert chat["tokens"] == job.prompt_ids  # what chat completions decode from
    info = engine.tokenizer_info()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    with pytest.raises(ApiError) as e:
        engine.detokenize(req(DetokenizeRequest, {"tokens": [10**7]}))
    assert e.value.param == "tokens"
    with pytest.raises(ApiError):  # both inputs
        req(TokenizeRequest, {"prompt": "a", "messages": CHAT["messages"]})


def test_vllm_s_seed_and_chat_template_flags(tiny_model_dir, tmp_path):
    """--seed: requests without a seed are reproducible across replicas started alike;
    --chat-template (a file here): chat prompts are built with it."""
    from tts_service.serve.api import TokenizeRequest
    from tts_service.serve.engine import ServeEngine

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")

    def engine(seed):
        model = {"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"}
        return ServeEngine(ServeConfig(model=model, seed=seed, chat_template=str(template)))

    body = {**CHAT, "temperature": 1.0, "n": 2, "max_tokens": 6}
    texts = []
    for seed in (5, 5, 6):
        eng = engine(seed)
        runs = [complete(eng, ChatCompletionRequest, body) for _ in range(2)]
        texts.append([c["message"]["content"] for r in runs for c in r["choices"]])
        eng.close()
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert texts[0][:2] != texts[0][2:]  # the second request drew new seeds
    req = parse(TokenizeRequest, json.dumps({"messages": CHAT["messages"]}).encode())
    tok = eng.generator.loaded.tokenizer
    assert (
        eng.tokenize(req)["tokens"]
        == tok("[What is 2 + 2?]", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(ValueError, match="readable file"):
        ServeConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_a_generation_config_sets_the_defaults_a_request_leaves_unset(tiny_model_dir, tmp_path):
    """vLLM's --generation-config: the folder's top_k 1 makes an unset top_k greedy, so a
    request at T = 1 answers what T = 0 answers; a request that sets top_k keeps its own."""
    from transformers import GenerationConfig

    from tts_service.serve.engine import ServeEngine

    GenerationConfig(do_sample=True, top_k=1, max_new_tokens=5).save_pretrained(tmp_path)
    model = {"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"}
    eng = ServeEngine(ServeConfig(model=model, generation_config=str(tmp_path)))
    try:
        assert eng.sampling_defaults == {"top_k": 1, "max_tokens": 5}
        body = {"messages": CHAT["messages"], "temperature": 1.0, "seed": 3}
        greedy = complete(eng, ChatCompletionRequest, {**body, "temperature": 0})
        sampled = complete(eng, ChatCompletionRequest, body)
        assert sampled["choices"][0]["message"] == greedy["choices"][0]["message"]
        assert sampled["usage"]["completion_tokens"] <= 5  # max_new_tokens: the default
        own = complete(eng, ChatCompletionRequest, {**body, "top_k": 0, "max_tokens": 12})
        assert own["usage"]["completion_tokens"] > 5
    finally:
        eng.close()
    plain = ServeEngine(ServeConfig(model=model, generation_config="vllm"))
    assert plain.sampling_defaults == {}
    plain.close()
