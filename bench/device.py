"""How fast the engine is on the device at hand: one command, any GPU (or a CPU), no weights.

    python -m bench.device --model-config qwen2.5-7b --json results/device-h100.json
    python -m bench.device --model-config tiny --device cpu            # CI-sized
    python -m bench.device --predict [--json PATH]       # predicted GPU figures (bench/predict.py)
    python -m bench.device --model-config qwen2.5-7b --repeat-kv   # transformers' GQA attention

Needs torch, transformers and the engine only (pydantic comes with the engine's configs): no
Ray, Redis, HTTP or downloads, so it runs on a bare GPU machine with no network. A named
architecture is built with random weights (bf16 on a GPU) from its published shape; `--model
PATH` loads local weights instead. It reports, in JSON:

* `plain_tokens_per_s`: our plain decoding of one sequence (static cache, CUDA graphs where
  they run), against `hf_generate_tokens_per_s` (`model.generate`, greedy) and
  `bandwidth_bound_tokens_per_s` (the device's measured copy bandwidth over the weight bytes:
  a decode step must read every weight once);
* `verify_cost_ms`: the verify step's cost surface T(rows, tree tokens) over a 512-token
  cache, {rows: {tokens: ms}};
* `replay`: **timing replay** of best-of-16. The engine runs real forwards with the trees each
  method's drafter builds from a logged trajectory file (the `tts replay` format), while
  acceptance follows the logged tokens (`tts_service.replay.LoggedOracle`): the device's
  tokens/s with real tree shapes and real acceptance, without real weights. Per method
  ({method: {tokens_per_s, acceptance_length, ...}}), all 16 responses of a problem in one
  batch, nodes sized by the runner's cost-aware allocator, against `hf_n16_tokens_per_s`
  (`generate(num_return_sequences=16)` on the same model, same lengths);
* `greedy_mismatch`: how often greedy speculative output differs from plain greedy on this
  model in its dtype and in float32 (in float32 it must be 0; in bf16 a tree forward and a
  sequential forward round differently, so outputs can split at near-ties).

`--predict` instead prints and writes (`--json`) the predicted best-of-16 table of
`bench/predict.py` (no GPU needed, seconds); where a CUDA GPU is present it also measures the
qwen2.5-7b shape on it and prints measured beside predicted (`compare_on_gpu`).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from pydantic import TypeAdapter
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from bench import predict as pr
from store.memory import InMemoryNgramStore
from tts_service.config import SamplingConfig
from tts_service.drafters.base import NoDrafter
from tts_service.drafters.registry import DraftEnv, DrafterConfig, build_drafter, method_drafter
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.compact import CompactCausalLM
from tts_service.engine.cost import sync_device
from tts_service.engine.decode import plain_generate
from tts_service.engine.graphs import bucket_of
from tts_service.engine.matmul import tune_linear_products
from tts_service.engine.metrics import StepPhases
from tts_service.models import LoadedModel
from tts_service.replay import LoggedProblem, TimedTarget, logged_requests, parse_line
from tts_service.runner import TrajectoryRunner
from tts_service.trajectory import RunReport

LOG = Path(__file__).with_name("trajectories-smollm2.jsonl.gz")

ARCHITECTURES = {
    "qwen2.5-7b": lambda: Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # SmolLM2's vocabulary, so the shipped log's token ids fit; everything else tiny
    "tiny": lambda: LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}
METHODS = ("plain", "stand", "auto")


REPEAT_KV = "repeat_kv_sdpa"
"""transformers' SDPA under a name the engine leaves as it is (`--repeat-kv`: the baseline of
grouped tree attention, `engine.attention`)."""
AttentionInterface.register(REPEAT_KV, sdpa_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(REPEAT_KV, sdpa_mask)


FORWARDS = ("transformers", "compact", "compiled")
"""The engine's forwards (`--forward`): transformers' modelling code, the compact forward
(`engine.compact`), and the compact forward with its kernels compiled."""


def engine_forward(model, forward: str):
    """`model` as the engine runs it under `forward` (one of `FORWARDS`)."""
    if forward == "transformers":
        return model
    compact = CompactCausalLM(model)
    if forward == "compiled":
        compact.compile()
    return compact


def build_model(
    name: str | None, path: str | None, device: str, dtype: torch.dtype, attn: str = "sdpa"
):
    """A named architecture with seeded random weights, or local weights from `path`."""
    if path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        return model.to(device).eval(), Path(path).name
    torch.manual_seed(0)
    cfg = ARCHITECTURES[name]()
    cfg._attn_implementation = attn
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval(), name


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    n = mib * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync_device(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / min(times[1:])


def timed(fn, device: torch.device) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - t0


def plain_speed(model, prompt: list[int], new_tokens: int) -> float:
    """Our plain decoding of one sequence: decode steps only (prefill excluded), tokens/s."""
    cfg = SamplingConfig(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    decoder = BatchDecoder(model, eos_ids=[])
    best = 0.0
    for _ in range(2):  # the first run captures the graphs
        row = decoder.new_row(prompt, NoDrafter(), cfg)
        decoder.join([row])
        steps = timed(lambda: [decoder.step(0) for _ in range(new_tokens)], model.device)
        best = max(best, new_tokens / steps)
    return best


def hf_speed(model, prompt: list[int], new_tokens: int, n: int = 1) -> float:
    """`model.generate` tokens/s of `n` sequences (sampled when n > 1): decode steps only, as
    the difference between `new_tokens` and 1 new token."""
    ids = torch.tensor([prompt], device=model.device)
    kw = {"do_sample": n > 1, "num_return_sequences": n, "pad_token_id": 0}
    if n == 1:
        kw.update(temperature=None, top_p=None, top_k=None)

    def run(k: int) -> None:
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)

    run(2)  # warm-up
    full = min(timed(lambda: run(new_tokens), model.device) for _ in range(2))
    one = min(timed(lambda: run(1), model.device) for _ in range(2))
    return n * (new_tokens - 1) / max(full - one, 1e-9)


def verify_surface(model, rows: list[int], tokens: list[int], context: int) -> dict:
    """{rows: {tokens: ms}}: the median of 3 timed verify steps, interleaved across shapes."""
    decoder = BatchDecoder(model, eos_ids=[])
    decoder.fill_random(max(rows), context)
    times: dict[tuple[int, int], list[float]] = {}
    for rnd in range(4):
        for r in rows:
            for t in tokens:
                s = decoder.time_forward(r, t)
                if rnd:
                    times.setdefault((r, t), []).append(s)
    return {
        str(r): {str(t): round(1000 * statistics.median(times[r, t]), 3) for t in tokens}
        for r in rows
    }


def read_log(path: Path, problems: int, max_tokens: int, context: int = 0) -> list[LoggedProblem]:
    """The first `problems` of a trajectory log, responses cut to `max_tokens`; `context` > 0
    lengthens each prompt to that many tokens (a reasoning-length context, `long_prompt`)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        logged = [parse_line(line) for line in f if line.strip()]
    if not logged[:problems]:
        raise SystemExit(f"no trajectories in {path}")
    return [
        LoggedProblem(
            p.prompt_id,
            long_prompt(logged, i, context) if context else p.prompt_ids,
            [r[:max_tokens] for r in p.responses],
            None if p.top_ids is None else [t[:max_tokens] for t in p.top_ids],
            None if p.top_probs is None else [t[:max_tokens] for t in p.top_probs],
        )
        for i, p in enumerate(logged[:problems])
    ]


def long_prompt(logged: list[LoggedProblem], index: int, context: int) -> list[int]:
    """Problem `index`'s prompt after logged text of the *other* problems (their prompts and
    responses, in turn), `context` tokens in all: a reasoning-length context whose tokens do
    not foretell the problem's own responses (a drafter finds no more in it than in real text)."""
    prompt = logged[index].prompt_ids
    others = [p for i, p in enumerate(logged) if i != index]
    text = [t for p in others for seq in (p.prompt_ids, *p.responses) for t in seq]
    if not text:
        raise SystemExit("a long context needs a log with more than one problem")
    need = max(context - len(prompt), 0)
    return (text * (need // len(text) + 1))[:need] + prompt


def replay_runner(
    model, problems: list[LoggedProblem], graph_acceptance: bool | None = None
) -> TrajectoryRunner:
    """A live runner over the logged problems, its rows as wide as a problem's best-of-N
    (`graph_acceptance`: `model.graph_acceptance`; None, the default: captured beside the
    forward's graphs)."""
    loaded = LoadedModel(
        model,
        None,
        (),
        model.device,
        model.dtype,
        "timing-replay",
        graph_acceptance=graph_acceptance,
    )
    return TrajectoryRunner(TimedTarget(loaded, problems), max(len(p.responses) for p in problems))


def timing_replay(
    model,
    method: str,
    problems: list[LoggedProblem],
    runner: TrajectoryRunner | None = None,
    graph_acceptance: bool | None = None,
    phases: StepPhases | None = None,
) -> dict:
    """Best-of-N of every logged problem through the live runner (`TrajectoryRunner`: its cost
    surface, allocator and drafters, continuous batching N rows wide) on the real device, with
    acceptance following the log; timed from submission to the last token, as a job waits.
    A fresh runner by default (a first job: surface from its prior, no graphs yet); `runner`,
    one that has served before (a Serve replica's next job: its surface, slot statistics and
    captured graphs kept). `phases`: how the steps' phases are clocked (by default on the host,
    the device's work landing where the host waits for it)."""
    fields = method_drafter(method, {}, "cuda" if model.device.type == "cuda" else "cpu")
    drafter = TypeAdapter(DrafterConfig).validate_python(fields)
    runner = runner or replay_runner(model, problems, graph_acceptance)
    runner.decoder.phases = phases or StepPhases()
    graphs = runner.decoder.graphs
    before = (graphs.captures, graphs.eager_steps) if graphs is not None else (0, 0)
    steps_before = runner.planner.steps if runner.planner is not None else 0
    report: list[RunReport] = []
    requests = logged_requests(problems, drafter)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    seconds = timed(lambda: report.append(runner.run(requests)), model.device)
    summary = report[0].summary()
    spec = summary["speculation"]
    phases = runner.decoder.phases  # where a step's time goes, per step (forward: launch + run)
    per_step = {k: round(v / phases.steps * 1e3, 3) for k, v in phases.seconds.items()}
    return {
        "tokens_per_s": round(summary["new_tokens"] / seconds, 2),
        "acceptance_length": summary["acceptance_length"],
        "target_forwards": summary["target_forwards"],
        "new_tokens": summary["new_tokens"],
        "seconds": round(seconds, 3),
        "drafted_steps": spec["drafted_steps"],
        "explored_steps": spec["explored_steps"],
        "cost_surface": spec["cost_surface"],
        "nodes_per_row": spec["nodes_per_row"],  # [t_s, rows, nodes] as the planner changed it
        "step_ms": per_step,
        "outside_steps_ms": round((seconds - sum(phases.seconds.values())) / phases.steps * 1e3, 3),
        # the device's peak allocation in this run (weights, KV, graphs' private pools)
        "peak_gib": round(torch.cuda.max_memory_allocated(model.device) / 2**30, 3)
        if model.device.type == "cuda"
        else None,
        # CUDA graphs in this run: captures (each the step eagerly and the capture), eager forwards
        "graphs": None
        if graphs is None
        else {
            "captures": graphs.captures - before[0],
            "eager_steps": graphs.eager_steps - before[1],
            "enabled": graphs.enabled,
        },
        # the acceptance's graphs (`model.graph_acceptance`): captured so far, still on
        "acceptance_graphs": None
        if runner.decoder.accept_graphs is None
        else {
            "captures": runner.decoder.accept_graphs.captures,
            "enabled": runner.decoder.accept_graphs.enabled,
        },
        # what the planner's last fresh decisions rested on (`PlanDecision`): which estimate
        # turned it, when `auto` runs below plain on a device
        "decisions": [
            {k: _rounded(v) for k, v in asdict(d).items()}
            for d in (runner.planner.decision_log if runner.planner is not None else ())
            if d.step > steps_before  # this job's (a served runner's planner kept the last's)
        ],
    }


def _rounded(value: object) -> object:
    """Seconds and token counts as JSON keeps them readably (6 significant digits)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, tuple):
        return [_rounded(v) for v in value]
    return value


def greedy_mismatch(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """Sequences whose greedy STAND output differs from plain greedy (and the first position
    of each difference)."""
    cfg = SamplingConfig(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    differing, first = 0, []
    for i, prompt in enumerate(prompts):
        ref = plain_generate(model, prompt, cfg, eos_ids=[]).token_ids
        env = DraftEnv(model.config.vocab_size, InMemoryNgramStore(), i)
        decoder = BatchDecoder(model, eos_ids=[])
        row = decoder.new_row(prompt, build_drafter(StandDrafterConfig(), env), cfg)
        decoder.join([row])
        while decoder.active:  # the engine alone, every step drafting the whole tree
            decoder.step(1024)
        spec = row.result()
        if spec.token_ids != ref:
            differing += 1
            pairs = enumerate(zip(spec.token_ids, ref, strict=False))
            first.append(next(j for j, (a, b) in pairs if a != b))
    return {"sequences": len(prompts), "differing": differing, "first_difference_at": first}


def gpu_spec(name: str) -> pr.Gpu | None:
    """The published figures of a device named like 'NVIDIA H100 80GB HBM3', if known."""
    return next((g for key, g in pr.GPUS.items() if key in name.upper()), None)


def measured_steps(model, records: list[dict], repeats: int = 3) -> list[dict]:
    """`records` of one (rows, context) with the device's own step time beside each: the
    median of `repeats` verify steps of `nodes + 1` tokens per row over a random cache of that
    context, and the tokens/s it gives with the predicted acceptance and host time."""
    rows, context = records[0]["rows"], records[0]["context"]
    decoder = BatchDecoder(model, eos_ids=[])
    # room for the widest padded step up front: growing later would double the cache
    widest = bucket_of(max(r["nodes"] for r in records) + 1)
    decoder.cache.reserve(bucket_of(rows), context + widest)
    decoder.fill_random(rows, context)
    out = []
    for r in records:
        width = r["nodes"] + 1
        decoder.time_forward(rows, width)  # warm-up (captures the graph)
        step = statistics.median(decoder.time_forward(rows, width) for _ in range(repeats))
        measured = rows * r["acceptance_length"] / (step + r["host_ms"] / 1e3)
        out.append(
            {
                **r,
                "measured_step_ms": round(step * 1e3, 3),
                "measured_tokens_per_s": round(measured, 1),
            }
        )
    return out


def compare_on_gpu(
    model,
    shape: pr.Shape,
    gpu: pr.Gpu,
    acceptance: dict,
    host: pr.HostTable,
    eff: float,
    problems: list[LoggedProblem],
    contexts: tuple[int, ...] = pr.CONTEXTS,
    keep: Path | None = None,
) -> list[dict]:
    """Measured beside predicted on the device at hand (one GPU): plain batch-1 decoding, the
    verify step at every (rows, context) that fits, and timing replay of best-of-16 on the
    held-out log (real trees, acceptance and host time) at the log's own context. `keep`: where
    the records measured so far are written after each (what a cut-short run leaves)."""
    out = []
    prompt = list(range(1, 65))
    plain1 = pr.predict_config(pr.Config(shape, gpu, 1, 1, 128), acceptance, host, eff)[0]
    out.append({**plain1, "measured_tokens_per_s": round(plain_speed(model, prompt, 128), 1)})
    fit, _ = pr.configs(gpu, [shape.name], [1], pr.ROWS, contexts)
    for cfg in fit:
        out += measured_steps(model, pr.predict_config(cfg, acceptance, host, eff))
        print(json.dumps(out[-1]), flush=True)  # progress, and what a cut-short run keeps
        if keep is not None:
            keep.write_text(json.dumps(out, indent=1) + "\n")
        if model.device.type == "cuda":  # the last cache's memory back before the next
            gc.collect()
            torch.cuda.empty_cache()
    tokens = [len(p.prompt_ids) + len(r) / 2 for p in problems for r in p.responses]
    rows = max(len(p.responses) for p in problems)
    cfg = pr.Config(shape, gpu, 1, rows, round(statistics.mean(tokens)))
    predicted = {r["method"]: r for r in pr.predict_config(cfg, acceptance, host, eff)}
    for method in METHODS:
        got = timing_replay(model, method, problems)
        out.append(
            {
                **predicted[method],
                "measured_tokens_per_s": got["tokens_per_s"],
                "measured_acceptance_length": got["acceptance_length"],
            }
        )
        print(json.dumps(out[-1]), flush=True)
        if keep is not None:
            keep.write_text(json.dumps(out, indent=1) + "\n")
    return out


def refitted(records: list[dict], shape: pr.Shape, gpu: pr.Gpu) -> tuple[pr.StepFit, list[dict]]:
    """The roofline refitted to the measured verify steps (`pr.refit`), and every measured
    record with what the refitted roofline predicts for it beside: `refit_tokens_per_s` (its
    acceptance and host time as predicted), `refit_step_ms` where a step was timed, and
    `refit_error`, measured ÷ refitted − 1 (the target: within ±0.25 everywhere)."""
    steps = [
        (r["rows"], r["nodes"] + 1, r["context"], r["measured_step_ms"] / 1e3)
        for r in records
        if "measured_step_ms" in r
    ]
    fit = pr.refit(shape, gpu, steps)
    out = []
    for r in records:
        step = fit.step_time(shape, gpu, r["rows"], r["nodes"] + 1, r["context"])
        tokens = r["rows"] * r["acceptance_length"] / (step + r["host_ms"] / 1e3)
        extra = {"refit_tokens_per_s": round(tokens, 1)}
        if "measured_step_ms" in r:
            extra["refit_step_ms"] = round(step * 1e3, 3)
        extra["refit_error"] = round(r["measured_tokens_per_s"] / tokens - 1, 3)
        out.append({**r, **extra})
    return fit, out


def side_by_side(rows: list[dict]) -> str:
    """Predicted (and, once refitted, the refitted prediction) against measured, one markdown
    line per record."""
    lines = [
        "| model | rows | context | method | nodes | acceptance | step ms pred / refit / meas | "
        "tokens/s pred / refit / meas | meas ÷ pred | meas ÷ refit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = f"{r['acceptance_length']:.2f}"
        if "measured_acceptance_length" in r:
            acc += f" / {r['measured_acceptance_length']:.2f}"
        step = f"{r['step_ms']:.2f} / {r.get('refit_step_ms', '–')} / " + (
            f"{r['measured_step_ms']:.2f}" if "measured_step_ms" in r else "–"
        )
        ratio = r["measured_tokens_per_s"] / r["tokens_per_s"]
        refit = r.get("refit_tokens_per_s")
        lines.append(
            f"| {r['model']} | {r['rows']} | {r['context']} | {r['method']} | {r['nodes']} | "
            f"{acc} | {step} | {r['tokens_per_s']:.0f} / {refit or '–'} / "
            f"{r['measured_tokens_per_s']:.0f} | {ratio:.2f} | "
            + (f"{r['measured_tokens_per_s'] / refit:.2f} |" if refit else "– |")
        )
    return "\n".join(lines)


def predict_main(args: argparse.Namespace) -> int:
    """`--predict`: the predicted table (and on a GPU, measured beside it); 2 if an input is
    missing."""
    if args.replay:
        nodes = [n for n in pr.NODE_CANDIDATES if n]
        table = pr.replay_acceptance(pr.HELDOUT_LOG, pr.METHODS, nodes)
        args.acceptance.parent.mkdir(parents=True, exist_ok=True)
        args.acceptance.write_text(json.dumps(table, indent=1) + "\n")
    try:
        host = pr.HostTable.read(args.host_json)
        acceptance = pr.read_acceptance(args.acceptance)
    except pr.MissingInput as e:
        print(f"bench.device --predict: {e}", file=sys.stderr)
        return 2
    eff = pr.fit_efficiency()
    h100 = pr.GPUS["H100"]
    fit, skip = pr.configs(h100)
    records = pr.predict(fit, acceptance, host, eff)
    print(
        f"roofline efficiency {eff:.4f} (fitted: llama-3.1-8b, 1× H100, batch 1 -> "
        f"{pr.ANCHOR_TOKENS_PER_S:.0f} tok/s); host {args.host_json}; "
        f"acceptance {args.acceptance}\n"
    )
    print(pr.markdown(records))
    print("\nper configuration (auto: the method it runs as, nodes per row, × plain):\n")
    print(pr.markdown_wide(records))
    print(
        "\nnot in bf16 memory: "
        + ", ".join(f"{c.shape.name} {c.gpus}× rows {c.rows} ctx {c.context}" for c in skip)
    )
    target = pr.Config(pr.SHAPES["qwen2.5-7b"], h100, 1, 16, 4096)
    print("\n" + pr.verdict(target, acceptance, host, eff))
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        gpu = gpu_spec(name)
        if gpu is None:
            print(f"\n{name}: no published figures to predict it with; nothing measured")
        else:
            torch.set_grad_enabled(False)
            print(f"\nmeasured on {name} (predicted for {gpu.name}), qwen2.5-7b random bf16:")
            model, _ = build_model("qwen2.5-7b", None, "cuda", torch.bfloat16)
            model = engine_forward(model, args.forward)
            log = read_log(pr.HELDOUT_LOG, 2, 256)
            shape = pr.SHAPES["qwen2.5-7b"]
            keep = args.json.with_name(args.json.stem + "-measured.json") if args.json else None
            measured = compare_on_gpu(
                model, shape, gpu, acceptance, host, eff, log, args.contexts, keep
            )
            fit, measured = refitted(measured, shape, gpu)
            print(side_by_side(measured))
            print(f"refitted: {fit}")
            records += [{**r, "device": name, "forward": args.forward} for r in measured]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-config", choices=sorted(ARCHITECTURES), default="tiny")
    src.add_argument("--model", help="a local model directory (weights are used as they are)")
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda:0")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, else float32)")
    ap.add_argument("--log", type=Path, default=LOG, help="trajectory log (JSONL, .gz ok)")
    ap.add_argument("--problems", type=int, default=4, help="logged problems to replay")
    ap.add_argument("--max-tokens", type=int, default=256, help="replay at most this per row")
    ap.add_argument("--new-tokens", type=int, default=128, help="plain decoding length")
    ap.add_argument("--rows", default="1,4,16", help="verify surface rows")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128", help="verify surface tokens")
    ap.add_argument("--context", type=int, default=512, help="verify surface: cached tokens a row")
    ap.add_argument(
        "--replay-context",
        type=int,
        default=0,
        help="timing replay: prompts lengthened to this many tokens (0: the logged prompts)",
    )
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--predict", action="store_true", help="predicted GPU figures (roofline)")
    ap.add_argument(
        "--repeat-kv",
        action="store_true",
        help="transformers' SDPA (KV repeated per query head) instead of grouped tree attention",
    )
    ap.add_argument(
        "--forward",
        choices=FORWARDS,
        default="transformers",
        help="our engine's forward (model.forward); model.generate keeps transformers'",
    )
    ap.add_argument("--host-json", type=Path, default=pr.HOST_JSON, help="bench.host records")
    ap.add_argument(
        "--acceptance",
        type=Path,
        default=pr.ACCEPTANCE_JSON,
        help="{method: {nodes: acceptance length}} from held-out replay",
    )
    ap.add_argument("--replay", action="store_true", help="recompute --acceptance first")
    ap.add_argument(
        "--contexts",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=pr.CONTEXTS,
        help="--predict on a GPU: the contexts whose verify steps are measured (comma-separated)",
    )
    args = ap.parse_args(argv)
    if args.predict:
        return predict_main(args)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    torch.set_grad_enabled(False)
    attn = REPEAT_KV if args.repeat_kv else "sdpa"
    model, model_name = build_model(args.model_config, args.model, str(device), dtype, attn)
    engine = engine_forward(model, args.forward)
    if device.type == "cpu":  # as the service loads a model on a CPU (model.tune_matmul)
        tune_linear_products(engine)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (64,), generator=gen).tolist()
    problems = read_log(args.log, args.problems, args.max_tokens, args.replay_context)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict = {
        "device": f"{name} ({device.type})",
        "model": model_name,
        "dtype": dtype_name,
        "attention": attn,
        "forward": args.forward,
        "surface_context": args.context,
        "replay_prompt_tokens": [len(p.prompt_ids) for p in problems],
        "parameters": sum(p.numel() for p in model.parameters()),
        "host": os.uname().nodename,
        "load_average": os.getloadavg()[0],
    }

    def progress(what: str) -> None:
        """Say what comes next, and write what is measured so far (a cut-short run keeps it)."""
        print(f"[device] {what}", file=sys.stderr, flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    progress(f"{report['device']}, {model_name} in {dtype_name}: bandwidth")
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 256)
    report["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    report["bandwidth_bound_tokens_per_s"] = round(bandwidth / weight_bytes(model), 1)
    progress("plain decoding, ours and model.generate (interleaved)")
    ours, hf = [], []
    for _ in range(2):
        ours.append(plain_speed(engine, prompt, args.new_tokens))
        hf.append(hf_speed(model, prompt, args.new_tokens))
    report["plain_tokens_per_s"] = round(max(ours), 2)
    report["hf_generate_tokens_per_s"] = round(max(hf), 2)
    report["plain_share_of_bound"] = round(max(ours) / report["bandwidth_bound_tokens_per_s"], 3)
    progress("verify cost surface")
    rows = [int(x) for x in args.rows.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    report["verify_cost_ms"] = verify_surface(engine, rows, tokens, args.context)
    progress(f"timing replay of {len(problems)} logged problems, best-of-N per batch")
    replay = {m: timing_replay(engine, m, problems) for m in METHODS}
    report["replay"] = replay
    n = max(len(p.responses) for p in problems)
    length = round(statistics.mean(len(r) for p in problems for r in p.responses))
    report["hf_n16_tokens_per_s"] = round(hf_speed(model, problems[0].prompt_ids, length, n), 2)
    for m in METHODS:
        replay[m]["vs_hf_n16"] = round(replay[m]["tokens_per_s"] / report["hf_n16_tokens_per_s"], 3)
    progress("greedy speculative vs plain output")
    prompts = [p.prompt_ids for p in problems]
    mismatch = {dtype_name: greedy_mismatch(engine, prompts, 64)}
    if dtype != torch.float32:
        single = model.float()
        mismatch["float32"] = greedy_mismatch(engine_forward(single, args.forward), prompts, 64)
    report["greedy_mismatch"] = mismatch
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
