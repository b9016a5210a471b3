"""Predicted GPU figures: best-of-N tokens/s per model shape, GPU count, rows and context, for
plain batched decoding and each method, from a roofline, the host benchmark and replay.

    python -m bench.device --predict [--json PATH] [--host-json PATH] [--acceptance PATH]

No GPU and no weights: a step's device time is a roofline (weight and KV bytes over bandwidth
against FLOPs over peak, divided by one efficiency factor fitted to a published batch-1 figure,
plus a tensor-parallel all-reduce term); the host adds its measured time per step
(`bench.host`); a method commits `acceptance_length(nodes)` tokens per row per step, from
offline replay of the held-out log. Per configuration the node count per row is the one that
maximises predicted tokens/s, as the runner's cost-aware allocator picks it on a cost curve.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tts_service.drafters.registry import AUTO_METHOD

BYTES = 2  # bf16 weights and KV
ANCHOR_TOKENS_PER_S = 158.0  # SGLang, Llama-3.1-8B, one H100, batch 1, no speculation
ANCHOR_CONTEXT = 512
ALL_REDUCE_LATENCY_S = 10e-6  # one NVLink all-reduce at decode sizes: latency-bound
NVLINK_BYTES_PER_S = 450e9  # H100/H200 NVLink 4, per direction per GPU
ALL_REDUCES_PER_LAYER = 2  # after attention and after the MLP (Megatron-style TP)
USABLE_MEMORY = 0.9  # weights + KV must fit in this share of the GPUs' memory (vLLM's default)
NODE_CANDIDATES = (0, 1, 2, 4, 8, 16, 32, 64)
METHODS = ("stand", "stand-dyn")
AUTO = AUTO_METHOD["cuda"]  # what `auto` drafts with on a GPU; where trees do not pay, plain
MODELS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "llama-3.1-70b")
GPU_COUNTS = (1, 2, 4, 8)
ROWS = (16, 64)
CONTEXTS = (4096, 16384)
ROOT = Path(__file__).resolve().parents[1]
HOST_JSON = ROOT / "bench/results/host-graph.json"  # the acceptance captured, as on CUDA
ACCEPTANCE_JSON = ROOT / "bench/results/acceptance-heldout.json"
HELDOUT_LOG = ROOT / "bench/trajectories-heldout-smollm2.jsonl.gz"


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's published shape: all the roofline needs."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, name: str, cfg) -> Shape:
        """From a transformers `PretrainedConfig` (Llama or Qwen2)."""
        return cls(
            name,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.vocab_size,
            bool(cfg.tie_word_embeddings),
            cfg.model_type == "qwen2",
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_parameters(self) -> int:
        kv = self.kv_heads * self.head_dim
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        bias = self.hidden + 2 * kv if self.qkv_bias else 0
        return attn + bias + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def parameters(self) -> int:
        """Every parameter (what the GPUs must hold)."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_parameters() + embed + self.hidden

    def read_parameters(self) -> int:
        """Parameters a decode step reads and multiplies by: all but the input embedding,
        whose lookup reads only the step's rows (tied: the table is read as the LM head)."""
        return self.layers * self.layer_parameters() + self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES


SHAPES = {
    s.name: s
    for s in (
        Shape("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, qkv_bias=True),  # = Qwen2-7B
        Shape("qwen2.5-14b", 48, 5120, 13824, 40, 8, 152064, qkv_bias=True),
        Shape("qwen2.5-32b", 64, 5120, 27648, 40, 8, 152064, qkv_bias=True),
        Shape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256),
        Shape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128256),
    )
}


@dataclass(frozen=True)
class Gpu:
    """One GPU's published figures (SXM parts, dense bf16)."""

    name: str
    bandwidth: float  # bytes/s of HBM
    flops: float  # FLOP/s
    memory: float  # bytes


GPUS = {
    "H100": Gpu("H100", 3.35e12, 989e12, 80e9),
    "H200": Gpu("H200", 4.8e12, 989e12, 141e9),
}


def roofline_parts(
    shape: Shape, gpu: Gpu, gpus: int, rows: int, tokens_per_row: int, context: int
) -> tuple[float, float]:
    """(seconds of memory traffic, seconds of arithmetic) of one step at peak: the weights
    once, each row's KV over its context once, and 2 FLOPs per parameter per token plus
    attention's 4 per layer per query width per context token; TP splits both `gpus` ways."""
    tokens = rows * tokens_per_row
    kv = rows * (context + tokens_per_row) * shape.kv_bytes_per_token()
    memory = (shape.read_parameters() * BYTES + kv) / (gpus * gpu.bandwidth)
    attention = 4 * shape.layers * shape.heads * shape.head_dim * context
    flops = tokens * (2 * shape.read_parameters() + attention)
    return memory, flops / (gpus * gpu.flops)


def all_reduce_time(shape: Shape, gpus: int, tokens: int) -> float:
    """Seconds of one step's tensor-parallel all-reduces: per layer `ALL_REDUCES_PER_LAYER`,
    each a fixed latency plus a ring's 2(g-1)/g of the activations over NVLink."""
    if gpus == 1:
        return 0.0
    ring = 2 * (gpus - 1) / gpus * tokens * shape.hidden * BYTES / NVLINK_BYTES_PER_S
    return shape.layers * ALL_REDUCES_PER_LAYER * (ALL_REDUCE_LATENCY_S + ring)


def step_time(
    shape: Shape,
    gpu: Gpu,
    gpus: int,
    rows: int,
    tokens_per_row: int,
    context: int,
    efficiency: float,
) -> float:
    """Seconds of one verify step on the device: the roofline's binding term over the fitted
    efficiency, plus the all-reduces (their constants are stated, not fitted)."""
    memory, compute = roofline_parts(shape, gpu, gpus, rows, tokens_per_row, context)
    return max(memory, compute) / efficiency + all_reduce_time(shape, gpus, rows * tokens_per_row)


def fit_efficiency() -> float:
    """The one factor that makes the roofline give the anchor: Llama-3.1-8B, one H100, one
    row, one token, a short context, no host time -> `ANCHOR_TOKENS_PER_S`."""
    shape, gpu = SHAPES["llama-3.1-8b"], GPUS["H100"]
    return ANCHOR_TOKENS_PER_S * step_time(shape, gpu, 1, 1, 1, ANCHOR_CONTEXT, 1.0)


class StepFit(NamedTuple):
    """The roofline refitted to one device's measured steps: a step takes the weights'
    roofline time (one shape on one device: a constant, so its own efficiency is not told
    apart from `fixed_s`) + `kv` × the cache's roofline time + `fixed_s` + `token_s` for each
    token in the step. (1.0, 0, 0) is the bare roofline."""

    kv: float
    fixed_s: float
    token_s: float

    def step_time(
        self, shape: Shape, gpu: Gpu, rows: int, tokens_per_row: int, context: int
    ) -> float:
        weights_s, kv_s, tokens = step_features(shape, gpu, rows, tokens_per_row, context)
        return weights_s + self.kv * kv_s + self.fixed_s + self.token_s * tokens


def step_features(
    shape: Shape, gpu: Gpu, rows: int, tokens_per_row: int, context: int
) -> tuple[float, float, float]:
    """The weights' and the cache's seconds at the device's bandwidth, and the step's tokens
    (one GPU)."""
    kv = rows * (context + tokens_per_row) * shape.kv_bytes_per_token()
    weights = shape.read_parameters() * BYTES
    return weights / gpu.bandwidth, kv / gpu.bandwidth, float(rows * tokens_per_row)


def refit(shape: Shape, gpu: Gpu, steps: Iterable[tuple[int, int, int, float]]) -> StepFit:
    """The non-negative terms that best give the measured `steps` ((rows, tokens a row,
    context, seconds) each), in relative error: a 2 ms step counts as much as a 40 ms one."""
    from scipy.optimize import nnls

    cells = [(step_features(shape, gpu, r, t, c), s) for r, t, c, s in steps]
    if len(cells) < 3:
        raise ValueError(f"refitting 3 terms needs 3 measured steps or more, not {len(cells)}")
    a = np.array([[kv_s / s, 1 / s, tokens / s] for (_, kv_s, tokens), s in cells])
    b = np.array([(s - weights_s) / s for (weights_s, _, _), s in cells])
    coef, _ = nnls(a, b)
    return StepFit(*(float(c) for c in coef))


def fits(shape: Shape, gpu: Gpu, gpus: int, rows: int, context: int) -> bool:
    """Weights and every row's KV (context plus the largest tree) in `USABLE_MEMORY`."""
    kv = rows * (context + max(NODE_CANDIDATES) + 1) * shape.kv_bytes_per_token()
    return shape.parameters() * BYTES + kv <= USABLE_MEMORY * gpus * gpu.memory


# -- host time ---------------------------------------------------------------------------------


class MissingInput(Exception):
    """An input file is absent; the message says which and how to make it."""


def _interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted `points`, clamped to the end values outside them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


@dataclass(frozen=True)
class HostTable:
    """Measured host milliseconds per step, {method: {rows: [(nodes, ms)]}}."""

    cells: dict[str, dict[int, list[tuple[float, float]]]]

    @classmethod
    def from_records(cls, records: Iterable[dict]) -> HostTable:
        """`bench.host`'s records (`rows`, `nodes`, `method`, `host_ms_per_step`); repeated
        cells are averaged."""
        sums: dict[tuple[str, int, int], list[float]] = defaultdict(list)
        for r in records:
            sums[r["method"], int(r["rows"]), int(r["nodes"])].append(float(r["host_ms_per_step"]))
        cells: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(dict)
        for (method, rows, nodes), ms in sorted(sums.items()):
            cells[method].setdefault(rows, []).append((nodes, sum(ms) / len(ms)))
        return cls(dict(cells))

    @classmethod
    def read(cls, path: Path) -> HostTable:
        if not path.exists():
            raise MissingInput(
                f"no host benchmark at {path}: run `python -m bench.host --json {path}` "
                "(or pass --host-json)"
            )
        return cls.from_records(json.loads(path.read_text()))

    def ms(self, method: str, rows: int, nodes: int) -> float:
        """Linear in nodes at each measured row count, then linear in rows; clamped."""
        if method not in self.cells:
            raise MissingInput(f"the host benchmark has no {method!r} records")
        by_rows = self.cells[method]
        return _interp([(r, _interp(by_rows[r], nodes)) for r in sorted(by_rows)], rows)


# -- acceptance --------------------------------------------------------------------------------


def read_acceptance_data(data: dict) -> dict[str, dict[int, float]]:
    """{method: {nodes: acceptance length}} from its JSON form (string keys)."""
    missing = [m for m in METHODS if m not in data]
    if missing:
        raise MissingInput(f"the acceptance table has no {missing[0]!r}: recompute it (--replay)")
    return {m: {int(n): float(a) for n, a in table.items()} for m, table in data.items()}


def read_acceptance(path: Path) -> dict[str, dict[int, float]]:
    """The table `replay_acceptance` wrote."""
    if not path.exists():
        raise MissingInput(f"no acceptance table at {path}: run with --replay to make it")
    return read_acceptance_data(json.loads(path.read_text()))


def replay_acceptance(
    log: Path, methods: Sequence[str], nodes: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Acceptance length of each method at each node cap, by offline replay of `log` (as
    `tts replay --method M --nodes N` gives it): minutes of CPU, hence kept as a file."""
    from tts_service.replay import read_log, replay, replay_config
    from tts_service.schemas import ReplayRequest

    problems, _ = read_log(log, strict=True)
    out: dict[str, dict[str, float]] = {}
    for method in methods:
        for n in nodes:
            req = ReplayRequest(method=method, trajectories=log, nodes=n)
            report = replay(problems, replay_config(req), n, req.vocab_size)
            out.setdefault(method, {})[str(n)] = round(report.to_dict()["acceptance_length"], 4)
    return out


# -- prediction --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    shape: Shape
    gpu: Gpu
    gpus: int
    rows: int
    context: int


def method_record(
    cfg: Config,
    method: str,
    nodes: int,
    acceptance: float,
    host: HostTable,
    efficiency: float,
) -> dict:
    """Tokens/s of `cfg` with `nodes` draft nodes per row: rows x acceptance length over the
    step's device time plus the host's."""
    args = (cfg.shape, cfg.gpu, cfg.gpus, cfg.rows, nodes + 1, cfg.context)
    memory, compute = roofline_parts(*args)
    step = step_time(*args, efficiency)
    host_s = host.ms(method, cfg.rows, nodes) / 1e3
    return {
        "model": cfg.shape.name,
        "gpu": cfg.gpu.name,
        "gpus": cfg.gpus,
        "rows": cfg.rows,
        "context": cfg.context,
        "method": method,
        "nodes": nodes,
        "acceptance_length": acceptance,
        "step_ms": round(step * 1e3, 3),
        "host_ms": round(host_s * 1e3, 3),
        "bound": "compute" if compute > memory else "memory",
        "tokens_per_s": round(cfg.rows * acceptance / (step + host_s), 1),
    }


def allocate(
    cfg: Config, method: str, table: dict[int, float], host: HostTable, efficiency: float
) -> dict:
    """The node count per row (0: a plain step) that maximises predicted tokens/s."""
    options = [(0, 1.0)] + [(n, table[n]) for n in NODE_CANDIDATES if n in table]
    records = [method_record(cfg, method, n, a, host, efficiency) for n, a in options]
    return max(records, key=lambda r: r["tokens_per_s"])


def predict_config(
    cfg: Config, acceptance: dict[str, dict[int, float]], host: HostTable, efficiency: float
) -> list[dict]:
    """Plain (`n=16` batched decoding: no tree, plain host time), each method at its chosen
    nodes, and `auto`: the better of plain and `AUTO`'s choice."""
    plain = method_record(cfg, "plain", 0, 1.0, host, efficiency)
    out = [plain]
    for method in METHODS:
        out.append(allocate(cfg, method, acceptance[method], host, efficiency))
    best = max([plain, *(r for r in out if r["method"] == AUTO)], key=lambda r: r["tokens_per_s"])
    out.append({**best, "method": "auto", "via": best["method"]})
    for r in out:
        r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
    return out


def configs(
    gpu: Gpu,
    models: Sequence[str] = MODELS,
    gpu_counts: Sequence[int] = GPU_COUNTS,
    rows: Sequence[int] = ROWS,
    contexts: Sequence[int] = CONTEXTS,
) -> tuple[list[Config], list[Config]]:
    """(configurations that fit in memory, those that do not)."""
    fit, skip = [], []
    for m in models:
        for g in gpu_counts:
            for r in rows:
                for c in contexts:
                    cfg = Config(SHAPES[m], gpu, g, r, c)
                    (fit if fits(cfg.shape, gpu, g, r, c) else skip).append(cfg)
    return fit, skip


def predict(
    cfgs: Iterable[Config],
    acceptance: dict[str, dict[int, float]],
    host: HostTable,
    efficiency: float | None = None,
) -> list[dict]:
    """Every record of every configuration (see `predict_config`)."""
    eff = fit_efficiency() if efficiency is None else efficiency
    return [r for cfg in cfgs for r in predict_config(cfg, acceptance, host, eff)]


# -- reporting ---------------------------------------------------------------------------------

COLUMNS = (
    ("model", "model"),
    ("gpus", "gpus"),
    ("rows", "rows"),
    ("context", "context"),
    ("method", "method"),
    ("nodes", "nodes"),
    ("acceptance_length", "acceptance length"),
    ("step_ms", "step ms"),
    ("host_ms", "host ms"),
    ("tokens_per_s", "tokens/s"),
    ("speedup", "× plain"),
)


def markdown(records: Sequence[dict]) -> str:
    """The records as a markdown table (`auto` names the method it ran as)."""

    def cell(r: dict, key: str) -> str:
        if key == "method" and "via" in r:
            return f"auto ({r['via']})"
        if key == "tokens_per_s":
            return f"{r[key]:.0f}"
        return f"{r[key]:.2f}" if isinstance(r[key], float) else str(r[key])

    lines = ["| " + " | ".join(t for _, t in COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in COLUMNS) + " |" for r in records]
    return "\n".join(lines)


def markdown_wide(records: Sequence[dict]) -> str:
    """One line per configuration: plain tokens/s, then each method's tokens/s (its nodes per
    row, its speedup over plain); the docs' table."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["gpus"], r["rows"], r["context"]), {})[r["method"]] = r
    names = [*METHODS, "auto"]
    lines = [
        "| model | GPUs | rows | context | plain tok/s | "
        + " | ".join(f"{m} tok/s (nodes, × plain)" for m in names)
        + " |",
        "|---" * (5 + len(names)) + "|",
    ]
    for (model, gpus, rows, context), by in groups.items():
        cells = []
        for m in names:
            r = by[m]
            via = f"{r['via']}, " if "via" in r else ""
            cells.append(f"{r['tokens_per_s']:.0f} ({via}{r['nodes']}, {r['speedup']:.2f}×)")
        plain = by["plain"]["tokens_per_s"]
        lines.append(
            f"| {model} | {gpus} | {rows} | {context} | {plain:.0f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def verdict(
    cfg: Config,
    acceptance: dict[str, dict[int, float]],
    host: HostTable,
    efficiency: float,
    target: float = 2.0,
) -> str:
    """`auto` ÷ plain for `cfg` and, short of `target`, what each term would allow if it alone
    changed: drafting's host time as cheap as plain's, no host time at all (both re-allocated),
    tree tokens free (the plain step's device time), or the acceptance needed at these nodes."""

    def ratio(h: HostTable) -> tuple[float, dict, dict]:
        recs = predict_config(cfg, acceptance, h, efficiency)
        plain, auto = recs[0], recs[-1]
        return auto["tokens_per_s"] / plain["tokens_per_s"], plain, auto

    now, p, a = ratio(host)
    text = (
        f"{cfg.shape.name}, {cfg.gpus}× {cfg.gpu.name}, {cfg.rows} rows, context "
        f"{cfg.context}: auto {a['tokens_per_s']:.0f} tok/s ({a['via']}, {a['nodes']} nodes, "
        f"acceptance {a['acceptance_length']:.2f}, step {a['step_ms']:.2f} ms + host "
        f"{a['host_ms']:.2f} ms) against plain {p['tokens_per_s']:.0f} tok/s (step "
        f"{p['step_ms']:.2f} ms + host {p['host_ms']:.2f} ms): {now:.2f}×"
    )
    if now >= target:
        return text + f", target {target:.0f}× met."
    plain_host = HostTable({m: host.cells["plain"] for m in ("plain", *METHODS)})
    no_host = HostTable({m: {1: [(0.0, 0.0)]} for m in ("plain", *METHODS)})
    free_tree = (
        a["acceptance_length"] * (p["step_ms"] + p["host_ms"]) / (p["step_ms"] + a["host_ms"])
    )
    needed = target * (a["step_ms"] + a["host_ms"]) / (p["step_ms"] + p["host_ms"])
    return text + (
        f", short of {target:.0f}×. If one term alone changed: drafting's host time as plain's "
        f"{ratio(plain_host)[0]:.2f}×; no host time {ratio(no_host)[0]:.2f}×; tree tokens free "
        f"{free_tree:.2f}×; at {a['nodes']} nodes it needs acceptance {needed:.2f} "
        f"(replay gives {a['acceptance_length']:.2f})."
    )
