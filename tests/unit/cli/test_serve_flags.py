"""`tts serve` takes `vllm serve`'s flags: parsed into the ServeConfig, nothing started."""

import argparse

import pytest

from tts_service.cli.serve import add_arguments, serve_config
from tts_service.cli.usage import UsageError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_vllm_s_flags_set_the_config():
    _, cfg = serve_config(
        parse(
            "some/model",
            "--tensor-parallel-size", "2",
            "--dtype", "half",
            "--seed", "7",
            "--max-num-seqs", "32",
            "--chat-template", "{{ messages }}",
            "--max-model-len", "2048",
        )
    )  # fmt: skip
    assert cfg.model.name == "some/model" and cfg.tensor_parallel == 2
    assert cfg.model.dtype == "float16" and cfg.seed == 7 and cfg.max_rows == 32
    assert cfg.chat_template == "{{ messages }}" and cfg.model.max_model_len == 2048
    assert serve_config(parse("--dtype", "float"))[1].model.dtype == "float32"
    assert serve_config(parse("--tensor-parallel", "2"))[1].tensor_parallel == 2  # ours too


def test_the_positional_model_and_model_flag_must_agree():
    assert serve_config(parse("m", "--model", "m"))[1].model.name == "m"
    with pytest.raises(UsageError, match="differ"):
        serve_config(parse("a", "--model", "b"))


def test_what_is_not_given_is_the_config_file_s():
    _, cfg = serve_config(parse())
    assert cfg.seed is None and cfg.chat_template is None and cfg.model.name == "smollm2-135m"
    with pytest.raises(SystemExit):  # argparse: exit code 2
        parse("--dtype", "int8")


def test_gpu_memory_utilization_is_refused_saying_what_bounds_memory_here():
    from tts_service.cli.serve import run

    with pytest.raises(UsageError, match="--max-num-seqs and --max-model-len"):
        run(parse("--gpu-memory-utilization", "0.9"))


def test_generation_config_and_strict_fields_flags():
    _, cfg = serve_config(parse("--generation-config", "vllm", "--reject-unknown-fields"))
    assert cfg.generation_config == "vllm" and cfg.reject_unknown_fields
    _, cfg = serve_config(parse())
    assert cfg.generation_config == "auto" and not cfg.reject_unknown_fields


def test_an_error_names_the_tensor_parallel_flag_as_typed():
    from tts_service.cli.common import typed_flag

    args = parse("--tensor-parallel-size", "3")
    args.argv = ["serve", "--tensor-parallel-size", "3"]
    assert (
        typed_flag(args, "--tensor-parallel", "--tensor-parallel-size") == "--tensor-parallel-size"
    )
    args.argv = ["serve", "--tensor-parallel=3"]
    assert typed_flag(args, "--tensor-parallel", "--tensor-parallel-size") == "--tensor-parallel"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "myhost"])
def test_binding_beyond_loopback_needs_a_key_or_an_explicit_yes(host, monkeypatch):
    monkeypatch.delenv("TTS_API_KEY", raising=False)
    with pytest.raises(UsageError, match=r"^--host: .* beyond loopback .*--allow-unauthenticated"):
        serve_config(parse("--host", host))
    assert serve_config(parse("--host", host, "--api-key", "k"))[1].host == host
    _, cfg = serve_config(parse("--host", host, "--allow-unauthenticated"))
    assert cfg.host == host and cfg.allow_unauthenticated and cfg.api_key is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host, monkeypatch):
    monkeypatch.delenv("TTS_API_KEY", raising=False)
    assert serve_config(parse("--host", host))[1].host == host
