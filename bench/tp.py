"""Tensor parallelism on this machine: the step time of greedy speculative decoding (PLD) on
one process against G ranks (gloo on CPU, `engine/tp.py`), the same random Llama, the same
rows, measured in the same run. On a 2-core CPU expect no gain: the ranks share the cores the
single process already uses, and every layer adds two all-reduces.

    python bench/tp.py [--ranks 2] [--rows 1 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from store.memory import InMemoryNgramStore
from tts_service.config import SamplingConfig
from tts_service.drafters.pld import PldDrafterConfig
from tts_service.drafters.registry import DraftEnv, build_drafter
from tts_service.engine import tp
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.cost import CostModel, VerifyCost

SHAPE = dict(  # ~110M parameters: big enough that the matrix products dominate
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def _prompts(rows: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 32000, (16,), generator=g).tolist() * 8 for _ in range(rows)]


def _steps_ms(decoder: BatchDecoder, rows: int, new_tokens: int) -> dict:
    """Decode `rows` rows to `new_tokens` each; ms per step (forwards after the prefill)."""
    env = DraftEnv(
        32000, InMemoryNgramStore(), 0, CostModel.fixed(VerifyCost((1, 2), (1.0, 1.0), 1))
    )
    cfg = SamplingConfig(temperature=0, max_new_tokens=new_tokens)
    batch = [
        decoder.new_row(p, build_drafter(PldDrafterConfig(), env), cfg) for p in _prompts(rows)
    ]
    decoder.join(batch)
    steps, t0 = 0, time.perf_counter()
    while decoder.active:
        decoder.step(15)
        steps += 1
    return {"rows": rows, "steps": steps, "ms_per_step": 1000 * (time.perf_counter() - t0) / steps}


def _rank(rank: int, ranks: int, port: int, path: str, rows: list[int], new: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    model = tp.load_sharded(path)
    with torch.inference_mode():
        if rank:
            tp.follow(model)
        else:
            _steps_ms(tp.leader_decoder(model, eos_ids=[]), 1, 4)  # warm-up
            results = []
            for r in rows:
                decoder = tp.leader_decoder(model, eos_ids=[])
                results.append(_steps_ms(decoder, r, new))
            tp.stop(decoder)
            Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.inference_mode():
            _steps_ms(BatchDecoder(model, []), 1, 4)  # warm-up
            single = [_steps_ms(BatchDecoder(model, []), r, args.new_tokens) for r in args.rows]
        del model
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = str(Path(tmp) / "ranks.json")
        mp.start_processes(
            _rank,
            args=(args.ranks, port, tmp, args.rows, args.new_tokens, out),
            nprocs=args.ranks,
        )
        sharded = json.loads(Path(out).read_text())
    g = args.ranks
    print(f"| rows | steps (1 process, {g} ranks) | 1 process ms/step | {g} ranks ms/step |")
    print("|---|---|---|---|")
    for a, b in zip(single, sharded, strict=True):
        steps = f"{a['steps']}, {b['steps']}"
        print(f"| {a['rows']} | {steps} | {a['ms_per_step']:.1f} | {b['ms_per_step']:.1f} |")


if __name__ == "__main__":
    main()
