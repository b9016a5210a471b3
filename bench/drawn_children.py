"""Drawn against deterministic children, exactly, on a sampled trajectory log (issue 31).

Under sampling, a node's children can be the store's top-k (deterministic, verified by
sample-and-match) or draws without replacement from the stored distribution q (verified by
recursive rejection sampling). Which one a node is more likely to accept does not need a
model: at every logged position the target's distribution p is logged (top-k, after
temperature), so the expected acceptance of either choice is a sum over p and q.

    python bench/drawn_children.py --trajectories bench/trajectories-heldout-smollm2.jsonl.gz \
        [--json bench/results/drawn-children.json]

For every position of every response (in log order, one STAND store per problem, fed with
every committed position's distribution, as the engine feeds it), where the store holds the
context: the probability that the first child is accepted, with 1 and 2 children, per the
order of the stored n-gram. p outside its logged top-k counts as 0, which lowers the drawn
figures only (a deterministic child is the store's top choice, almost always inside p's
top-k). Replay (`tts replay`) cannot measure drawn children: given the logged token, the
trees that hold it are more likely than their prior, so following the log would need the
drafts reweighted.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tts_service.replay import read_log

Dist = dict[int, float]


def top_k_accept(p: Dist, q: Dist, k: int) -> float:
    """Sample-and-match over q's k most likely ids: the first k candidates, p's mass on them."""
    best = sorted(q, key=lambda t: (-q[t], t))[:k]
    return sum(p.get(t, 0.0) for t in best)


def drawn_accept(p: Dist, q: Dist, k: int) -> float:
    """Recursive rejection sampling over k children drawn without replacement from q: the
    probability that one of them is accepted, exactly (enumerated over q's ids)."""
    if k == 0 or not q:
        return 0.0
    total = sum(q.values())
    out = 0.0
    for x, qx in q.items():
        qi = qx / total
        accept = min(1.0, p.get(x, 0.0) / qi)
        rest = {t: max(0.0, p.get(t, 0.0) - q.get(t, 0.0) / total) for t in p}
        mass = sum(rest.values()) + max(0.0, 1.0 - sum(p.values()))
        later = 0.0
        if mass > 1e-12:
            residual = {t: v / mass for t, v in rest.items()}
            later = drawn_accept(residual, {t: v for t, v in q.items() if t != x}, k - 1)
        out += qi * (accept + (1.0 - accept) * later)
    return out


def measure(path: Path, max_order: int = 4) -> dict:
    """The four expected acceptances summed per stored order, and the positions counted."""
    problems, _ = read_log(path, strict=True)
    sums: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for problem in problems:
        if problem.top_ids is None or problem.top_probs is None:
            raise SystemExit(f"{path}: the log has no top-k distributions")
        store = InMemoryNgramStore(max_order=max_order)
        for r, response in enumerate(problem.responses):
            tokens = list(problem.prompt_ids)
            for t, token in enumerate(response):
                ids, probs = problem.top_ids[r][t], problem.top_probs[r][t]
                p = dict(zip(ids, probs, strict=True))
                tail = tuple(tokens[-max_order:])
                entry = store.lookup(tail)
                if entry is not None and entry.ids:
                    q = {i: v for i, v in zip(entry.ids, entry.probs, strict=True) if v > 0}
                    cell = sums[entry.order]
                    cell["positions"] += 1
                    cell["top1"] += top_k_accept(p, q, 1)
                    cell["drawn1"] += drawn_accept(p, q, 1)
                    cell["top2"] += top_k_accept(p, q, 2)
                    cell["drawn2"] += drawn_accept(p, q, 2)
                store.add([NgramRow(tail, tuple(ids), tuple(probs))])
                tokens.append(token)
    return {str(order): dict(cell) for order, cell in sorted(sums.items())}


def table(path: Path, sums: dict) -> list[dict]:
    """Per stored order and over all: the mean of each acceptance."""
    rows = []
    everything: dict[str, float] = defaultdict(float)
    for order, cell in sums.items():
        for key, value in cell.items():
            everything[key] += value
        rows.append({"order": order, **cell})
    rows.append({"order": "all", **everything})
    out = []
    for row in rows:
        n = row["positions"]
        means = {k: round(row[k] / n, 4) for k in ("top1", "drawn1", "top2", "drawn2")}
        out.append({"log": path.name, "order": row["order"], "positions": int(n), **means})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=Path, nargs="+", required=True)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    rows = [row for path in args.trajectories for row in table(path, measure(path))]
    print("| log | stored order | positions | top-1 | drawn 1 | top-2 | drawn 2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['log']} | {r['order']} | {r['positions']} | {r['top1']:.3f} | "
            f"{r['drawn1']:.3f} | {r['top2']:.3f} | {r['drawn2']:.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
