"""Tensor parallelism on 2 CPU ranks (gloo, fp32): a sharded replica's verify logits equal the
single-process model's, step by step through joins, leaves and compaction, and its greedy
speculative output is token-identical to plain single-process decoding."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tts_service.config import SamplingConfig
from tts_service.engine import tp
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.decode import plain_generate
from tts_service.engine.options import DecoderOptions

VOCAB, RANKS = 64, 2
DRAFTERS = ("stand", "pld")
PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9], [3, 30, 31, 3, 30], [7], [40, 41, 42, 43, 40, 41]]
MAX_NEW = (24, 10, 20, 16)  # rows leave at different steps


FAMILIES = {
    "llama": lambda: tiny_llama(vocab_size=VOCAB, seed=0, dtype=torch.float32, scale=8.0),
    "qwen2": lambda: tiny_llama(
        vocab_size=VOCAB, seed=0, dtype=torch.float32, scale=8.0, family="qwen2"
    ),
}


@torch.inference_mode()
def _decode(decoder: BatchDecoder, drafter: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Two rows join, decode a few steps, two more join; every row to its end, the cache
    compacted after every other step. Returns each row's tokens and every verify forward's
    logits."""
    logits: list[torch.Tensor] = []
    forward = decoder._forward

    def recording(*args):
        out = forward(*args)
        logits.append(out.detach().clone())
        return out

    decoder._forward = recording  # type: ignore[method-assign]
    rows = [
        decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[drafter], VOCAB, seed=i), cfg)
        for i, (p, cfg) in enumerate(
            zip(
                PROMPTS,
                [SamplingConfig(temperature=0, max_new_tokens=n) for n in MAX_NEW],
                strict=True,
            )
        )
    ]
    decoder.join(rows[:2])
    for _ in range(3):
        decoder.step(15)
    decoder.join(rows[2:])
    while decoder.active:
        decoder.step(15)
        if decoder.active and len(logits) % 2:
            decoder._compact()
    return [list(r.result().token_ids) for r in rows], logits


def _rank(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=120))
    try:
        model = tp.load_sharded(model_dir)
        if rank:
            tp.follow(model)
            return
        results = {}
        for drafter in DRAFTERS:
            for full_view in (False, True):
                decoder = tp.leader_decoder(model, eos_ids=[], compact_slack=0, full_view=full_view)
                results[drafter, full_view] = _decode(decoder, drafter)
                results[drafter, full_view] += (decoder.cache.kv_heads,)
        tp.stop(decoder)
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_match_the_single_process_model(tmp_path, family):
    """Every verify forward's logits within 1e-5 of one process's (joins, leaves and KV
    compaction every step included); greedy STAND and PLD output equals plain greedy."""
    FAMILIES[family]().save_pretrained(tmp_path / "model")
    out = tmp_path / "rank0.pt"
    mp.start_processes(
        _rank, args=(_free_port(), str(tmp_path / "model"), str(out)), nprocs=RANKS, join=True
    )
    sharded = torch.load(out)
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    plain = [
        plain_generate(full, p, SamplingConfig(temperature=0, max_new_tokens=n), eos_ids=[])
        for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    for (drafter, full_view), (tokens, logits, kv_heads) in sharded.items():
        decoder = BatchDecoder(
            full, eos_ids=[], options=DecoderOptions(compact_slack=0, full_view=full_view)
        )
        ref_tokens, ref_logits = _decode(decoder, drafter)
        assert kv_heads == decoder.cache.kv_heads // RANKS  # each rank caches its heads
        assert tokens == ref_tokens == [list(p.token_ids) for p in plain], (drafter, full_view)
        assert len(logits) == len(ref_logits) > len(PROMPTS)
        for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{drafter} step {step}")
