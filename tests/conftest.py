"""Shared fixtures: seeded tiny random Llama models (no hub, no network), every drafter, and a
private redis-server."""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import pytest
import torch
from pydantic import TypeAdapter
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from store.base import NgramRow
from store.local_server import LocalRedisCluster, LocalRedisServer
from store.memory import InMemoryNgramStore
from tts_service.drafters.recycling import RecyclingDrafterConfig
from tts_service.drafters.registry import (
    KINDS,
    METHODS,
    DraftEnv,
    DrafterConfig,
    build_drafter,
    method_drafter,
    size_field,
)
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig
from tts_service.engine.cost import CostModel, VerifyCost

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# learned cost surfaces go to a directory of this session's, not the user's cache
os.environ.setdefault("TTS_COST_CACHE", tempfile.mkdtemp(prefix="tts-cost-"))

# every registered method (the registry's, `TTS_DRAFTERS` included) with small trees (fast on a
# tiny model: 16 nodes unless named here), plus a few variants
_TEST_SIZES = {"pld": 5, "stand_spine": 24, "goose": 24, "gtcp": 48, "stand_dyn": 48}
_TEST_EXTRA = {"stand": {"tree": "stand-625"}, "stand_spine": {"tree": "stand-625", "min_match": 2}}
TEST_PRESETS = {
    kind: {size_field(kind): _TEST_SIZES.get(kind, 16), **_TEST_EXTRA.get(kind, {})}
    for kind in KINDS
    if size_field(kind)
}
# the in-tree families that draft from the text so far: the harnesses hold them to an acceptance
# bar on repeated prompts (a regression check); any other family that drafts, a new one
# included (it needs no line here), only to some draft accepted there, not every one rejected
COPYING_KINDS = frozenset(
    {"pld", "recycling", "stand", "stand_spine", "goose", "gtcp", "stand_dyn"}
)
_TEST_FIELDS = {"recycle-gt": {"num_nodes": 40}, "stand-gt": {"num_nodes": 40, "tree": "stand-80"}}
DRAFTER_CONFIGS = {
    name: TypeAdapter(DrafterConfig).validate_python(
        {**method_drafter(name, TEST_PRESETS, "cpu"), **_TEST_FIELDS.get(name, {})}
    )
    for name in METHODS
} | {
    "recycling-80": RecyclingDrafterConfig(num_nodes=80),
    "stand-80-deterministic": StandDrafterConfig(num_nodes=80, tree="stand-625", stochastic=False),
    "stand-40-harvest": StandDrafterConfig(num_nodes=40, tree="stand-625", harvest_rejected=True),
    # `stand-dyn` drafts compiled (stand_dyn_compiled); the Python drafter stays in every harness
    "stand-dyn-python": StandDynDrafterConfig(num_nodes=48, compiled=False),
    # drawn children compiled (`auto` on a CPU draws them in Python)
    "stand-dyn-drawn": StandDynDrafterConfig(num_nodes=48, drawn=True),
    # `stand` drafts in Python on a CPU (the registry's preset); its compiled drafter too
    "stand-compiled": StandDrafterConfig(num_nodes=16, tree="stand-625", compiled=True),
}

# a verify cost where tree tokens are nearly free (a GPU's headroom): GT keeps big trees, so the
# lossless harnesses see them; the GT tests use steeper curves of their own
FLAT_COST = VerifyCost((1, 2, 128), (1.0, 1.01, 1.2), 256)


def tiny_llama(
    vocab_size: int = 64,
    seed: int = 0,
    dtype=torch.float64,
    scale: float = 1.0,
    family: str = "llama",
    hidden_size: int = 32,
    intermediate_size: int = 64,
):
    """A seeded random Llama (or Qwen2, `family="qwen2"`); float64 keeps greedy ties out of the
    way (docs/design.md, "Testing exactness").

    `scale` multiplies the lm_head so the distributions are peaked enough to be interesting;
    a wider `hidden_size` / `intermediate_size` makes a forward's cost grow with its tokens.
    """
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = model_cls(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama(vocab_size=64, seed=0, scale=8.0)


@pytest.fixture(params=sorted(DRAFTER_CONFIGS))
def drafter_config(request):
    return DRAFTER_CONFIGS[request.param]


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server on a free loopback port for the session (tests use their own scopes).
    Skipped where redis-server is not installed, so the unit tests run without it."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """One Redis Cluster (3 masters, a replica each) on loopback ports for the session; tests
    use their own scopes and must not kill its nodes (test_redis_cluster.py has its own)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli not installed (apt-get install -y redis-server)")
    with LocalRedisCluster(masters=3, replicas=1) as cluster:
        yield cluster


def make_drafter(cfg, vocab_size: int, seed: int = 0):
    """Any registered drafter; store-based ones get a fresh in-process store of their own."""
    return build_drafter(
        cfg, DraftEnv(vocab_size, InMemoryNgramStore(), seed, CostModel.fixed(FLAT_COST))
    )


def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over `vocab_size` ids, "w0", "w1", ..., none special
    (so every id survives a decode). Unknown words read as "w0".

    It lets a tiny-vocabulary model run through every entry that takes text (actors, Serve)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def save_tiny_model(path, vocab_size: int, seed: int, scale: float, dtype=torch.float32):
    """A seeded tiny Llama with no EOS and a word-level tokenizer, saved as a local model."""
    model = tiny_llama(vocab_size=vocab_size, seed=seed, dtype=dtype, scale=scale)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    model.save_pretrained(path)
    word_tokenizer(vocab_size).save_pretrained(path)
    return model


def ngram_steps(seed: int, n: int, rows: int = 3) -> list[list[NgramRow]]:
    """`n` decoding steps of `rows` store rows each: random 4-token contexts, 10 ids each (the
    store tests' traffic)."""
    rng = random.Random(seed)
    return [
        [
            NgramRow(
                tuple(rng.randrange(1000) for _ in range(4)),
                tuple(rng.sample(range(100), 10)),
                (0.1,) * 10,
            )
            for _ in range(rows)
        ]
        for _ in range(n)
    ]


def logged_rows(url: str, scope_id: str, scope: str = "problem") -> tuple[int, int]:
    """What a scope's log holds, as a process that opens it now applies it (a late joiner's
    replay): (rows applied, the sum of its 1-gram counts). Each row adds 1 to exactly one
    1-gram's count, so the two agree when no row was applied twice."""
    from store.redis_store import RedisLogitNgramStore, RedisScope

    reader = RedisLogitNgramStore.connect(url, scope=RedisScope(scope, scope_id))
    try:
        counts = reader.index.count[reader.index.keytok[:, 0] == 1]
        return reader.stats()["remote_updates"], int(counts.sum())
    finally:
        reader.close()
