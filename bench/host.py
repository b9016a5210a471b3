"""How long the host keeps a GPU waiting: the real runner, decoder and drafters over a
stand-in target whose forward costs nothing.

    python -m bench.host --json bench/results/host.json          # the whole matrix
    python -m bench.host --rows 16 --nodes 8 --method stand-dyn  # one cell
    python -m bench.host --rows 16 --nodes 8 --method stand-dyn --store local-redis
                                                                 # the problems' stores in a
                                                                 # private redis-server
    python -m bench.host --rows 16 --nodes 8 --device-ms 10      # a device forward of 10 ms
                                                                 # (a 7B step on an H100)
    python -m bench.host --method stand-dyn --set drawn=true     # a drafter field changed
    python -m bench.host --rows 16 --nodes 8 --layers 28         # a 7B's depth of KV cache
    python -m bench.host --device cuda --json runs/host-gpu.json # on a GPU: CUDA launches and
                                                                 # the step's one sync included
    python -m bench.host --speculation cost                      # `auto`'s runner: the planner
                                                                 # and slot statistics too
    python -m bench.host --graph-acceptance                      # the acceptance captured per
                                                                 # bucket (a CPU: replayed
                                                                 # eagerly, as device work)

On a GPU a 7B decode step for 16 rows takes a few milliseconds and tree tokens are nearly
free, so the step time is whatever the host does between two forwards. This measures that
host time where no GPU is needed.

**The stand-in target.** A trajectory log (the `tts replay` format, with the target's top-k at
every position) stands in for the model: at a row's committed position `p`, a tree node at depth
`d` gets the logged distribution of position `p + d` as its logits, whatever its path. The
decoder packs, verifies (greedy or sampled, from the row's own random stream), accepts, keeps
the KV cache and lets the drafters observe exactly as it does over a model; only the forward
is replaced, and its time is not counted. Every tree node gets a logged distribution, so with
`harvest_rejected` (`stand-dyn`'s default) the store also takes the rejected nodes' (which are
the logged path's, not theirs): the harvest's cost is measured, but acceptance reads lower
than the real model's (`--set harvest_rejected=false` for the old cells). Token ids are folded
into a small vocabulary (`--vocab`, by frequency rank), so the tensor arithmetic a GPU would
absorb is negligible and what remains is Python and op dispatch, as a GPU host sees it.

Per step it reports the critical-path host time, from the end of one forward to the launch of
the next (joins excluded: a prefill is a forward), split by the decoder's phases
(`engine.metrics.PHASES`: draft, pack, verify, accept, kv, observe) plus `runner` (the
runner's own work between steps: with `--speculation cost`, `auto`'s planner deciding each
step over a 7B's roofline on one H100, at most `--nodes` per row, at this host's measured
drafting cost, its surface untaught (`measure`)); and `ops_per_step`, the torch ops
dispatched per step outside the forward (torch.profiler, top-level aten ops), of which
`leave_ops_per_step` moved rows up as finished ones left the batch (`leaves_per_step` such
moves: the logged responses are short, so rows leave far more often than over a reasoning
trace thousands of tokens long, and how often grows with the rows); and
`collector_passes_per_step`, the cyclic collector's passes in the measured steps (the young
budget widened as a runner host widens it, `engine.collector`: its passes then run in the
forward's shadow, counted in `overlap_ms_per_step`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from pydantic import TypeAdapter
from transformers import LlamaConfig, LlamaForCausalLM

from bench.methods import with_fields
from bench.predict import BYTES, GPUS, SHAPES, fit_efficiency
from store.config import StoreConfig
from store.factory import open_store
from store.local_server import LocalRedisServer
from tts_service.drafters import stand, stand_dyn
from tts_service.drafters.kernels import preload
from tts_service.drafters.registry import DrafterConfig, method_drafter
from tts_service.engine import collector
from tts_service.engine.allocate import SpeculationPlanner
from tts_service.engine.batch import BatchDecoder, Row
from tts_service.engine.graphs import EagerReplayedAcceptance, GraphedAcceptance
from tts_service.engine.metrics import PHASES
from tts_service.engine.options import DecoderOptions
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.surface import CostSurface, ModelShape, Roofline, power_bucket
from tts_service.replay import LoggedProblem, LoggedTarget, parse_line, sized_fields
from tts_service.runner import MAX_NODES, Speculation, TrajectoryRow, TrajectoryRunner
from tts_service.trajectory import TrajectoryRequest

LOG = Path(__file__).with_name("trajectories-heldout-smollm2.jsonl.gz")
ROWS, NODES, METHODS = (1, 16, 64), (0, 8, 32), ("plain", "stand", "stand-dyn")
FLOOR = -30.0  # the stand-in's logit for a token outside the logged top-k


def fold(problems: Sequence[LoggedProblem], vocab: int) -> list[LoggedProblem]:
    """The problems with every token id replaced by its frequency rank modulo `vocab` (the
    most frequent `vocab` ids keep distinct ids)."""
    counts: Counter[int] = Counter()
    for p in problems:
        counts.update(p.prompt_ids)
        for r in p.responses:
            counts.update(r)
    rank = {t: i % vocab for i, (t, _) in enumerate(counts.most_common())}

    def ids(seq: Sequence[int]) -> list[int]:
        return [rank.get(t, t % vocab) for t in seq]

    return [
        LoggedProblem(
            p.prompt_id,
            ids(p.prompt_ids),
            [ids(r) for r in p.responses],
            [[ids(row) for row in resp] for resp in p.top_ids or []],
            p.top_probs,
        )
        for p in problems
    ]


def response_logits(problem: LoggedProblem, r: int, vocab: int) -> torch.Tensor:
    """`[len + 1, V]` stand-in logits for response `r`: log of the logged top-k at each
    position (ids that fold together add up), `FLOOR` elsewhere; past the end, token 0."""
    assert problem.top_ids is not None and problem.top_probs is not None
    n = len(problem.responses[r])
    probs = torch.zeros(n + 1, vocab, dtype=torch.float32)
    for t in range(n):
        ids = torch.tensor(problem.top_ids[r][t])
        probs[t].index_add_(0, ids, torch.tensor(problem.top_probs[r][t], dtype=torch.float32))
    probs[n, 0] = 1.0
    return torch.where(probs > 0, probs.log(), torch.full_like(probs, FLOOR))


class StandInDecoder(BatchDecoder):
    """The engine's decoder with the forward replaced by the log (module docstring); it keeps
    joins (prefill forwards) out of the measured host time."""

    last_step_steady = False  # a forward that costs nothing has nothing to teach the surface

    def __init__(
        self,
        model,
        problems: Sequence[LoggedProblem],
        vocab: int,
        defer: bool,
        graph_acceptance: bool = False,
        device_s: float = 0.0,
    ) -> None:
        super().__init__(
            model,
            eos_ids=[],
            options=DecoderOptions(
                cuda_graphs=False, defer_observation=defer, graph_acceptance=graph_acceptance
            ),
        )
        self.acceptance.gather_sparse = True  # rule (c) as a GPU host runs it: every node gathered
        if graph_acceptance and self.device.type == "cuda":
            # a captured acceptance though the stand-in's forward is not captured (the engine
            # captures it only beside the forward's graphs): its fresh logits, 256 wide, are
            # copied into the captured ones each step
            self.accept_graphs = GraphedAcceptance(self.device)
        self.problems, self.vocab = problems, vocab
        self.device_s = device_s  # the device's forward, waited for without the GIL
        self.logits: dict[int, torch.Tensor] = {}  # id(row) -> its response's stand-in logits
        self._depths = torch.zeros(0, 0, dtype=torch.long)
        self.join_s = 0.0
        self.leaves = 0  # moves of rows up as rows left: a step's finished ones, or a drop

    def admit(self, rows: list[Row]) -> None:
        t0 = time.perf_counter()
        with torch.profiler.record_function("join"):
            for row in rows:
                req = cast(TrajectoryRow, row).request
                problem = self.problems[int(req.problem_id)]
                logits = response_logits(problem, req.index, self.vocab)
                self.logits[id(row)] = logits.to(self.device)
            super().admit(rows)
        self.join_s += time.perf_counter() - t0

    def prefill(self, tokens: int | None = None) -> list[Row]:
        t0 = time.perf_counter()
        with torch.profiler.record_function("join"):
            joined = super().prefill(tokens)
        self.join_s += time.perf_counter() - t0
        return joined

    def _pack(self, tb, shape):
        self._depths = tb.depths
        return super()._pack(tb, shape)

    def _forward(self, ids, pos, mask, start: int) -> torch.Tensor:
        with torch.profiler.record_function("forward"):
            out = torch.full((*ids.shape, self.vocab), FLOOR, device=self.device)
            for b, row in enumerate(self.active):
                table = self.logits[id(row)]
                at = (len(row.rule.out) + self._depths[b]).clamp_(max=table.shape[0] - 1)
                out[b, : at.shape[0]] = table[at]
        return out

    def _in_forwards_shadow(self) -> None:
        """The deferred observation, then the rest of the device's forward waited for (a
        GPU's step: the host syncs, the GIL free), as `device_s` says; counted as overlap."""
        launched = time.perf_counter()
        super()._in_forwards_shadow()
        left = self.device_s - (time.perf_counter() - launched)
        if left > 0:
            time.sleep(left)

    def flush_observations(self) -> None:
        with torch.profiler.record_function("overlap"):
            super().flush_observations()

    def _keep_rows(self, keep: list[int]) -> None:
        self.leaves += 1
        with torch.profiler.record_function("leave"):
            super()._keep_rows(keep)

    def drop(self, rows: list[Row]) -> None:
        super().drop(rows)
        for row in rows:
            self.logits.pop(id(row), None)


class StandInTarget(LoggedTarget):
    """The runner's model: `LoggedTarget`'s drafters over the stand-in decoder."""

    def __init__(
        self,
        problems: Sequence[LoggedProblem],
        vocab: int,
        defer: bool = True,
        device: str = "cpu",
        layers: int = 1,
        graph_acceptance: bool = False,
        device_s: float = 0.0,
    ) -> None:
        super().__init__(problems, vocab)
        self.defer = defer
        self.graph_acceptance, self.device_s = graph_acceptance, device_s
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=8192,
        )
        torch.manual_seed(0)
        # prefills and shapes the KV cache only
        self.model = LlamaForCausalLM(cfg).to(device).eval()

    def new_decoder(self) -> StandInDecoder:
        return StandInDecoder(
            self.model,
            self.problems,
            self.vocab,
            self.defer,
            self.graph_acceptance,
            self.device_s,
        )


def requests(
    problems: Sequence[LoggedProblem],
    method: str,
    nodes: int,
    temperature: float,
    overrides: Sequence[str] = (),
    store_url: str | None = None,
) -> list[TrajectoryRequest]:
    """Every logged response as a request, problem by problem (each problem its own store:
    in-process, or with `store_url` a fresh scope of that Redis); `overrides`: FIELD=VALUE
    drafter fields (`bench.methods.with_fields`)."""
    # the drafter as a GPU runs it (compiled where it is there): the host a GPU waits for
    fields = sized_fields(method_drafter(method, {}, "cuda"), max(nodes, 1))
    fields = with_fields(fields, list(overrides))
    cfg = TypeAdapter(DrafterConfig).validate_python(fields)
    out = []
    run = uuid.uuid4().hex[:8]
    for i, problem in enumerate(problems):
        store = open_store(StoreConfig(), store_url, "problem", f"bench-host-{run}-{i}")
        for r, response in enumerate(problem.responses):
            if len(response) < 8:
                continue
            params = SamplingParams(
                temperature, max_new_tokens=len(response), seed=r, ignore_eos=True
            )
            out.append(
                TrajectoryRequest(str(i), r, problem.prompt_ids, params, cfg, store, run_nonce=0)
            )
    return out


def top_level_ops(prof: torch.profiler.profile, outside: tuple[str, ...]) -> int:
    """aten ops dispatched by Python (not from inside another aten op), outside the named
    record_function scopes."""
    count = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name in outside:
                nested = True
                break
            parent = parent.cpu_parent
        count += not nested
    return count


def gpu_surface() -> CostSurface:
    """The planner's cost surface for a stand-in: Qwen2.5-7B in bf16 on one H100, at the
    roofline (`bench.predict`'s shape and device, its fitted efficiency). The stand-in's
    steps never teach it (`StandInDecoder.last_step_steady`)."""
    shape, gpu, eff = SHAPES["qwen2.5-7b"], GPUS["H100"], fit_efficiency()
    read = shape.read_parameters()
    model = ModelShape(
        weight_bytes=float(read * BYTES),
        kv_bytes_per_token=float(shape.kv_bytes_per_token()),
        flops_per_token=float(2 * read),
        attention_flops_per_key=float(4 * shape.layers * shape.heads * shape.head_dim),
    )
    return CostSurface(Roofline(model, gpu.bandwidth * eff, gpu.flops * eff, 0.0))


def measure(
    problems: Sequence[LoggedProblem],
    vocab: int,
    rows: int,
    nodes: int,
    method: str,
    steps: int,
    temperature: float,
    defer: bool = True,
    device: str = "cpu",
    overrides: Sequence[str] = (),
    layers: int = 1,
    speculation: Speculation = "fixed",
    graph_acceptance: bool = False,
    store_url: str | None = None,
    device_ms: float = 0.0,
) -> dict:
    """One cell: `steps` measured steps after a warm-up, then `steps // 4` under the profiler.

    `speculation="cost"` runs the runner as `auto` runs it: slot statistics recorded every
    step and the planner deciding every step (k = 0..64 priced), over a 7B's roofline on one
    H100 (`gpu_surface`), at most `nodes` per row. Unlike a live runner's, its surface is never
    taught (the stand-in's forward costs nothing) and it decides on the estimate itself (z = 0),
    so it re-reads its cost lines every 4 steps, not also after surprises; the drafting it
    prices is this host's. `"fixed"`: exactly `nodes` per row, no planner.

    `graph_acceptance`: the acceptance captured per bucket (`graphs.GraphedAcceptance`). On a
    CPU its replays run eagerly (`EagerReplayedAcceptance`) and count as the device's work, as
    the stand-in forward does: out of the host time (`graph_ms`, their own) and the op count."""
    target = StandInTarget(
        problems, vocab, defer, device, layers, graph_acceptance, device_ms / 1e3
    )
    runner = TrajectoryRunner(target, rows, speculation, token_budget=(nodes + 1) * rows)
    if speculation == "cost":
        # as the runner builds it (k = 0..MAX_NODES priced every decision), with the step's
        # tokens capped so that no row gets more than `nodes`; z = 0: decide on the roofline
        # itself (the cautious bound would price a 7B tree step at 2.2x plain's, with nothing
        # timed to say otherwise)
        cap = (nodes + 1) * power_bucket(rows)
        runner.planner = SpeculationPlanner(
            surface=gpu_surface(), max_nodes=MAX_NODES, max_step_tokens=cap, z=0.0
        )
    submitted = requests(problems, method, nodes, temperature, overrides, store_url)
    runner.submit(submitted)
    dec = cast(StandInDecoder, runner.decoder)
    for _ in range(8):  # warm-up: rows joined, stores and tables not empty
        runner.tick()
    phases0, join0, steps0 = dict(dec.phases.seconds), dec.join_s, dec.phases.steps
    replay0 = replay_seconds(dec)
    drafted0, rows0 = dec.forwards.draft_nodes, dec.forwards.row_forwards
    tokens0 = dec.forwards.new_tokens
    passes = []  # the collector's, in the measured steps (`engine.collector`)
    gc.callbacks.append(on_pass := lambda phase, info: passes.append(phase == "start"))
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            runner.tick()
    finally:
        gc.callbacks.remove(on_pass)
    wall = time.perf_counter() - t0 - (dec.join_s - join0)
    done = dec.phases.steps - steps0
    measured_rows = dec.forwards.row_forwards - rows0  # rows drafted for, summed over steps
    split = {k: (dec.phases.seconds[k] - phases0[k]) * 1e3 / done for k in PHASES}
    forward_ms, overlap_ms = split.pop("forward"), split.pop("overlap")
    graph_ms = (replay_seconds(dec) - replay0) * 1e3 / done
    split["verify"] -= graph_ms
    host_ms = wall * 1e3 / done - forward_ms - overlap_ms - graph_ms
    split["runner"] = host_ms - sum(split.values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        s0, leaves0 = dec.phases.steps, dec.leaves
        for _ in range(max(steps // 4, 4)):
            runner.tick()
        profiled, leaves = dec.phases.steps - s0, dec.leaves - leaves0
    device_work = ("forward", "join", "overlap", "graph")
    ops = top_level_ops(prof, device_work) / profiled
    leave_ops = ops - top_level_ops(prof, (*device_work, "leave")) / profiled
    f = dec.forwards
    for store in {id(r.store): r.store for r in submitted}.values():
        store.close()
    return {
        "rows": rows,
        "nodes": nodes,
        "method": method,
        "store": "in-process" if store_url is None else "redis",
        "device_ms": device_ms,
        "speculation": speculation,
        "set": list(overrides),
        "temperature": temperature,
        "layers": layers,
        "steps": done,
        "mean_rows": round(f.row_forwards / f.forwards, 2),
        "nodes_per_row": round((f.draft_nodes - drafted0) / (f.row_forwards - rows0), 2),
        "acceptance_length": round((f.new_tokens - tokens0) / (f.row_forwards - rows0), 3),
        "deferred_observation": defer,
        "host_ms_per_step": round(host_ms, 3),
        "overlap_ms_per_step": round(overlap_ms, 3),
        "split_ms": {k: round(v, 3) for k, v in split.items()},
        # issue 31's drafting budget (<= 40 us a row-step at 8 nodes), over the measured steps
        "draft_us_per_row_step": round(split["draft"] * 1e3 * done / measured_rows, 1),
        "standin_forward_ms": round(forward_ms, 3),
        "graph_acceptance": graph_acceptance,
        "graph_ms": round(graph_ms, 3),
        "captures": dec.accept_graphs.captures if dec.accept_graphs is not None else 0,
        "ops_per_step": round(ops, 1),
        "leave_ops_per_step": round(leave_ops, 1),
        "leaves_per_step": round(leaves / profiled, 2),
        "collector_passes_per_step": round(sum(passes) / done, 3),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
    }


def replay_seconds(dec: BatchDecoder) -> float:
    """Seconds the decoder's acceptance replays ran eagerly so far (a CPU's stand-in for a
    graph's device work; 0 without them, or on a GPU, where a replay is a launch)."""
    graphs = dec.accept_graphs
    return graphs.replay_s if isinstance(graphs, EagerReplayedAcceptance) else 0.0


def read_problems(path: Path) -> list[LoggedProblem]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [parse_line(line) for line in f if line.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--nodes", type=int, nargs="*", default=list(NODES))
    ap.add_argument("--method", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--steps", type=int, default=40, help="measured steps per cell")
    ap.add_argument("--temperature", type=float, default=0.6, help="0: greedy rows")
    ap.add_argument("--vocab", type=int, default=256, help="the stand-in's vocabulary")
    ap.add_argument("--log", type=Path, default=LOG, help="trajectory log with top-k")
    ap.add_argument("--json", type=Path, help="write the records here (a JSON list)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the host path a GPU sees")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="the stand-in's layers: its KV cache's, whose rewrites are host work (a 7B: 28)",
    )
    ap.add_argument(
        "--speculation",
        choices=("fixed", "cost"),
        default="fixed",
        help="cost: the planner decides each step (as `auto`), up to --nodes; fixed: --nodes",
    )
    ap.add_argument(
        "--inline-observation", action="store_true", help="observe before the next draft"
    )
    ap.add_argument(
        "--graph-acceptance",
        action="store_true",
        help="capture the acceptance per bucket (on a CPU: replayed eagerly, counted as device "
        "work)",
    )
    ap.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="the stand-in forward's device time, waited for as a sync waits (the GIL free: "
        "the store's replication threads run then, as beside a GPU's forward); not counted",
    )
    ap.add_argument(
        "--store",
        help="the problems' stores: a Redis URL (redis://..., redis+cluster://...), or "
        "'local-redis' (a private redis-server); default in-process",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a drafter field (a JSON value) for every method whose drafter has it: drawn=true",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    problems = fold(read_problems(args.log), args.vocab)
    # the compiled kernels loaded before any cell, as a GPU runner host has them before its
    # first step (`Generator.load` preloads them; a CPU runner loads them at its first compiled
    # draft): else their load (~0.2 s, numba's cache) lands in whichever measured step first
    # walks or drafts with them
    for module in (stand.KERNELS, stand_dyn.KERNELS):
        preload(module).join()
    # the log is the stand-in's data, not the engine's: keep its ~10^6 objects out of the
    # cyclic collector, whose full passes over them (~100 ms each, wherever the allocation
    # count happens to trigger one) otherwise land in some cells' measured steps
    gc.collect()
    gc.freeze()
    collector.widen()  # as a runner host does once it is up (`actors.host.RunnerHost`)
    with contextlib.ExitStack() as stack:
        url = args.store
        if url == "local-redis":
            url = stack.enter_context(LocalRedisServer()).url
        return run_cells(args, problems, url)


def run_cells(args: argparse.Namespace, problems: list[LoggedProblem], url: str | None) -> int:
    """Every (method, rows, nodes) cell, printed and written as it goes."""
    records = []
    load = os.getloadavg()[0]
    for method in args.method:
        for rows in args.rows:
            for nodes in args.nodes if method != "plain" else [0]:
                rec = measure(
                    problems,
                    args.vocab,
                    rows,
                    nodes,
                    method,
                    args.steps,
                    args.temperature,
                    not args.inline_observation,
                    args.device,
                    args.set,
                    args.layers,
                    args.speculation,
                    args.graph_acceptance,
                    url,
                    args.device_ms,
                )
                rec["load"] = round(load, 2)
                records.append(rec)
                split = " ".join(f"{k} {v:.2f}" for k, v in rec["split_ms"].items())
                print(
                    f"{method:10s} rows {rows:3d} nodes {nodes:3d}: "
                    f"{rec['host_ms_per_step']:8.2f} ms/step  {rec['ops_per_step']:6.0f} ops "
                    f"({rec['leave_ops_per_step']:.0f} in leaves)  "
                    f"AL {rec['acceptance_length']:.2f} "
                    f"draft {rec['draft_us_per_row_step']:.0f} us/row [{split}]",
                    flush=True,
                )
                load = os.getloadavg()[0]
                if args.json:  # as it goes: a cut-short run keeps what it measured
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
