"""The `transformers` peer of `bench/auto_speed.py`: best-of-N with `model.generate` as a user
runs it, one process per run, so that process start to exit is timed as a user sees it.

    python bench/hf_peer.py --problems FILE.jsonl [--model DIR] [--n 16] [--temperature 0.6]
        [--max-new-tokens 64] [--seed 0]

The weights are the service's: `--model` is the fp32 SmolLM2 directory `tts solve` loads
(`tts_service.models.model_source`, resolved here when not given; `bench/auto_speed.py` resolves
it once and passes it, so the timed process imports only torch and transformers, as a user's
script would). The model is loaded as `load_model` loads it on a CPU (`from_pretrained`, fp32,
eval) without the service's per-shape matrix products, the model a user gets (what
`bench/best_of_n.py`'s `hf` configuration restores). Each problem (a JSONL line with `question`,
jobs' format, or `prompt`) is encoded with the chat template as `tts solve` encodes it
(`encode_prompt`), then `generate(num_return_sequences=n)` at T > 0; greedy decoding has no
`num_return_sequences`, so at T = 0 the prompt is repeated n times in one batch. New tokens are
counted as `bench/best_of_n.py` counts them: each row up to and including its first end token.
Prints one JSON line: new_tokens, decode_s (the `generate` calls only), load_s, tokens_per_s.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def model_dir() -> str:
    """Where `tts solve` reads the default model from (imports the service: call it untimed)."""
    from tts_service.config import ModelConfig
    from tts_service.models import model_source

    return str(model_source(ModelConfig()))


def read_questions(path: Path) -> list[str]:
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    return [r.get("question", r.get("prompt")) for r in rows]


def encode(tokenizer: Any, question: str) -> list[int]:
    """One user turn plus the assistant header: `tts_service.models.encode_prompt(chat=True)`."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return [int(i) for i in encoded["input_ids"]]


def end_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a row, the generation config's first (`models._eos_ids`)."""
    ids: list[int] = []
    for src in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        for value in src if isinstance(src, Iterable) else [src]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return ids


def count_new_tokens(rows: list[list[int]], eos: set[int]) -> int:
    """Tokens per row up to and including the first end token (`bench/best_of_n.py`'s rule:
    a finished row stays in the batch, padded, until the longest one ends)."""
    return sum(next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row)) for row in rows)


def generate(
    model: Any, ids: list[int], n: int, temperature: float, max_new: int, pad: int
) -> list[list[int]]:
    """One problem's n trajectories in one `generate` call; returns the new token ids."""
    x = torch.tensor([ids], device=model.device)
    if temperature > 0:
        kwargs = dict(
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=None,
            num_return_sequences=n,
        )
    else:  # greedy: no num_return_sequences, so the batch is the prompt n times
        x = x.repeat(n, 1)
        kwargs = dict(do_sample=False)
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, pad_token_id=pad, **kwargs
    )
    return out[:, len(ids) :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=Path, required=True)
    ap.add_argument("--model", help="the model directory (default: the one tts solve loads)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    source = args.model or model_dir()

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    load_s = time.perf_counter() - t0
    problems = [encode(tokenizer, q) for q in read_questions(args.problems)]
    eos = end_ids(model, tokenizer)
    tokens = 0
    t0 = time.perf_counter()
    for ids in problems:  # as best_of_n.py: the seed set per problem
        torch.manual_seed(args.seed)
        rows = generate(model, ids, args.n, args.temperature, args.max_new_tokens, eos[0])
        tokens += count_new_tokens(rows, set(eos))
    decode_s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "new_tokens": tokens,
                "decode_s": decode_s,
                "load_s": load_s,
                "tokens_per_s": tokens / decode_s,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
