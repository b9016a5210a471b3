"""The evaluation report over every run in an output directory: JSON, Markdown and PNG plots.

A run is `<out>/<task>/<method>/` with `run.json` (what was asked, and one `sessions` entry per
invocation that ran it: when, on which host, under what load, and its speed) and `items.jsonl`
(one graded row per item). Runs of several methods in one directory are compared side by side.
A speed ratio to plain decoding is given only when both runs were measured in one invocation;
runs measured apart (another time, host or load) are listed with those conditions and never
divided. Written: `report.json`, `report.md`, `accuracy_vs_n.png` (maj@k and pass@k against k
per task), `speed.png` (tokens/s and acceptance length per method), and lm-eval's layout
(`lm-eval/<model>/results_<time>.json`, `samples_<task>_<time>.jsonl`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from tts_service.tasks.metrics import ItemOutcome, summarize

TITLES = {"aime24": "AIME-2024", "gpqa": "GPQA-Diamond", "lcb": "LiveCodeBench"}
DEFINITIONS = {
    "pass@1": "fraction of trajectories correct, averaged over items",
    "maj@N": "majority vote of the N trajectories is correct",
    "pass@N": "at least one of the N trajectories is correct",
    "pass@k": "unbiased estimator 1 - C(N-c,k)/C(N,k) (Chen et al. 2021)",
    "maj@k": "majority vote of the first k trajectories is correct",
    "no_answer_rate": "fraction of trajectories with no extractable answer, averaged over items",
    "grader_errors": "trajectories the grader could not grade (counted wrong, reason kept in "
    "items.jsonl)",
    "truncation_rate": "fraction of trajectories stopped by the token limit (finish_reason "
    "length), averaged over items",
    "tokens_per_s": "all new tokens over the whole wall time of the run's sessions: what the "
    "user waited for, from the process's start (its first session) or the previous session's "
    "end, setup (model loads, Ray) and grading included",
    "decode_tokens_per_s": "all new tokens over the decoding alone: from the models' readiness "
    "to the last trajectory of each session (metrics.summarize), the progress lines' figure",
    "wall_s / setup_s / decode_s": "the sessions' whole seconds, the part before and beside "
    "decoding (wall_s - decode_s), and the decoding's",
    "speed_vs_plain": "decode tokens/s over plain's on the same task, only when both were "
    "measured in one invocation; otherwise cross-run and not computed",
    "acceptance_length": "committed tokens per target forward, bonus token included",
    "intervals": "95% percentile bootstrap over items (scipy.stats.bootstrap), 1000 "
    "resamples, seed 0",
}


TRUNCATION_WARNING = 0.2
"""The share of trajectories stopped by the token limit above which a run is warned about: their
answers are cut off, and accuracy measures the limit, not the model."""


def truncation_warning(rate: float, max_new_tokens: int | None) -> str | None:
    """The warning for a run whose trajectories hit the token limit more than
    `TRUNCATION_WARNING` of the time (None below it)."""
    if rate <= TRUNCATION_WARNING:
        return None
    limit = f" ({max_new_tokens:,} tokens)" if max_new_tokens else ""
    return (
        f"{rate:.0%} of trajectories stopped at sampling.max_new_tokens{limit}: their answers are "
        "cut off; raise it (--set sampling.max_new_tokens=32768 for reasoning models, "
        "docs/real-models.md)"
    )


def run_warnings(report: dict) -> list[str]:
    """Each run's truncation warning, named by its task and method."""
    found = []
    for r in report["runs"]:
        limit = (r.get("sampling") or {}).get("max_new_tokens")
        warning = truncation_warning(r["metrics"]["truncation_rate"]["value"], limit)
        if warning:
            found.append(f"{r['task']}/{r['method']}: {warning}")
    return found


def read_rows(path: Path) -> list[dict]:
    """Complete JSONL rows (a line cut by a crash is skipped; its item is redone)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "id" in row:
            rows.append(row)
    return rows


def outcome(row: dict) -> ItemOutcome:
    stats, trajectories = row["stats"], row.get("trajectories", [])
    return ItemOutcome(
        correct=tuple(row["correct"]),
        maj_correct={int(k): v for k, v in row["maj_correct"].items()},
        new_tokens=stats["new_tokens"],
        target_forwards=stats["target_forwards"],
        no_answer=sum(t["answer"] is None for t in trajectories),
        truncated=sum(t["finish_reason"] == "length" for t in trajectories),
        confidence_correct=row.get("confidence_correct"),
        filtered_correct=row.get("filtered_correct"),
    )


def measured(run: dict) -> list[dict]:
    """The run's invocations that generated anything (a resume of a finished run does not)."""
    return [s for s in run.get("sessions", []) if s["new_tokens"] > 0]


def decode_s(session: dict) -> float:
    """A session's decoding seconds (sessions recorded before `decode_s` existed timed only
    the decoding, as `wall_s`)."""
    return session.get("decode_s", session["wall_s"])


def speed(run: dict) -> dict:
    """The speed over every measuring invocation: summed new tokens over the summed whole wall
    time (`tokens_per_s`) and over the summed decoding time (`decode_tokens_per_s`)."""
    sessions = measured(run)
    tokens = sum(s["new_tokens"] for s in sessions)
    wall = sum(s["wall_s"] for s in sessions)
    decode = sum(decode_s(s) for s in sessions)
    return {
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "decode_tokens_per_s": round(tokens / decode, 3) if decode > 0 else None,
        "wall_s": round(wall, 2),
        "setup_s": round(wall - decode, 2),
        "decode_s": round(decode, 2),
        "sessions": sessions,
    }


def versus_plain(run: dict, plain: dict | None) -> dict:
    """The speed ratio to `plain`, computed only when every measurement of both was made in one
    invocation (interleaved: `jobs.evaluate --method plain,...`)."""
    if plain is None or plain is run:
        return {"ratio": None, "basis": "no plain run" if plain is None else "plain itself"}
    invocations = {s["invocation"] for s in (*measured(run), *measured(plain))}
    if len(invocations) != 1:
        return {"ratio": None, "basis": "cross-run"}
    a, b = run["speed"]["decode_tokens_per_s"], plain["speed"]["decode_tokens_per_s"]
    return {"ratio": round(a / b, 3) if a and b else None, "basis": "same invocation"}


def build(out: Path) -> dict:
    """The report's content from every finished row under `out`."""
    runs = []
    for run_file in sorted(out.glob("*/*/run.json")):
        run = json.loads(run_file.read_text(encoding="utf-8"))
        rows = read_rows(run_file.with_name("items.jsonl"))
        if not rows:
            continue
        run["metrics"] = summarize([outcome(r) for r in rows])
        run["metrics"]["grader_errors"] = sum(r.get("grader_errors", 0) for r in rows)
        run["speed"] = speed(run)
        runs.append(run)
    for run in runs:
        plain = next(
            (
                p
                for p in runs
                if p["task"] == run["task"] and (p["drafter"] or {}).get("kind") == "plain"
            ),
            None,
        )
        run["speed_vs_plain"] = versus_plain(run, plain)
    sandbox = next((r["sandbox"] for r in runs if r.get("sandbox")), None)
    return {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": runs,
        "sandbox": sandbox,
        "definitions": DEFINITIONS,
    }


def source(run: dict) -> str:
    """Where the items came from, in words."""
    if run.get("endpoint"):
        where = f"endpoint {run['endpoint']}"
    else:
        where = "tts-service"
    data = run["data"] + " (toy items shipped with tts-service)" * (run["data"] == "fixtures")
    return f"data {data}, generated by {where}"


def caption(runs: list[dict]) -> str:
    """Model, data source and item count of the runs drawn together."""
    models = ", ".join(sorted({r["model"] for r in runs}))
    data = ", ".join(sorted({r["data"] for r in runs}))
    items = "/".join(str(n) for n in sorted({r["metrics"]["items"] for r in runs}))
    return f"model {models}; data {data}; {items} items"


def _cell(e: dict | None) -> str:
    return f"{e['value']:.3f} [{e['low']:.3f}, {e['high']:.3f}]" if e else "-"


def _rate(tokens_per_s: float | None) -> str:
    return f"{tokens_per_s:.1f}" if tokens_per_s else "-"


def _speed_cell(run: dict) -> str:
    versus = run["speed_vs_plain"]
    if versus["ratio"] is not None:
        return f"{versus['ratio']:.2f}x (same invocation)"
    return "cross-run: not compared" if versus["basis"] == "cross-run" else "-"


def _sessions(runs: list[dict]) -> list[str]:
    """When, where and under what load each run's speed was measured."""
    lines = [
        "Speed measurements (tokens/s is all new tokens over the whole wall seconds, setup "
        "included; decode tokens/s over the decoding's alone; a ratio is given only between "
        "runs of one invocation):",
        "",
        "| method | invocation | started (UTC) | host | load avg 1 min, start / end "
        "| wall / setup / decode s | tokens/s | decode tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        for s in r["speed"]["sessions"]:
            decode = decode_s(s)
            lines.append(
                f"| {r['method']} | {s['invocation']} | {s['started']} | {s['host']} "
                f"| {s['loadavg_start'][0]:.2f} / {s['loadavg_end'][0]:.2f} "
                f"| {s['wall_s']:.1f} / {s['wall_s'] - decode:.1f} / {decode:.1f} "
                f"| {s['new_tokens'] / s['wall_s']:.1f} | {s['new_tokens'] / decode:.1f} |"
            )
    if any(r["speed_vs_plain"]["basis"] == "cross-run" for r in runs):
        lines += [
            "",
            "**Cross-run:** these methods were measured in different invocations (times, "
            "hosts and loads above), so their tokens/s are not divided into a speed-up.",
        ]
    return [*lines, ""]


def markdown(report: dict) -> str:
    lines = ["# Evaluation report", "", f"Generated {report['generated']}.", ""]
    warnings = [f"> **Warning**: {w}" for w in run_warnings(report)]
    lines += [*warnings, ""] if warnings else []
    for task in sorted({r["task"] for r in report["runs"]}):
        runs = [r for r in report["runs"] if r["task"] == task]
        lines += [f"## {TITLES.get(task, task)} (`{task}`)", ""]
        for r in runs:
            lines.append(f"- `{r['method']}`: model `{r['model']}`, {source(r)}")
        lines += [
            "",
            "| method | items | N | pass@1 | maj@N | pass@N | no answer | truncated | tokens/s "
            "| decode tokens/s | wall / setup / decode s | acceptance length | speed vs plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in runs:
            m, sp = r["metrics"], r["speed"]
            lines.append(
                f"| {r['method']} | {m['items']} | {m['n']} | {_cell(m['pass@1'])} "
                f"| {_cell(m['maj@n'])} | {_cell(m['pass@n'])} | {_cell(m['no_answer_rate'])} "
                f"| {_cell(m['truncation_rate'])} | {_rate(sp['tokens_per_s'])} "
                f"| {_rate(sp['decode_tokens_per_s'])} "
                f"| {sp['wall_s']:.1f} / {sp['setup_s']:.1f} / {sp['decode_s']:.1f} "
                f"| {_cell(m['acceptance_length'])} | {_speed_cell(r)} |"
            )
        lines += [""] + [
            f"- `{r['method']}`, the same samples by other votes: confidence-weighted maj@N "
            f"{_cell(r['metrics']['confidence_maj@n'])}, filtered (90% most confident) maj@N "
            f"{_cell(r['metrics']['filtered_maj@n'])}"
            for r in runs
            if "confidence_maj@n" in r["metrics"]
        ]
        lines += ["", *_sessions(runs)]
        lines += ["Accuracy against the number of trajectories k (maj@k / pass@k):", ""]
        ks = sorted({k for r in runs for k in r["metrics"]["curve"]["k"]})
        lines += ["| method | " + " | ".join(f"k={k}" for k in ks) + " |"]
        lines += ["|---|" + "---|" * len(ks)]
        for r in runs:
            c = r["metrics"]["curve"]
            at = {k: (c["maj@k"][i], c["pass@k"][i]) for i, k in enumerate(c["k"])}
            cells = [
                f"{at[k][0]['value']:.3f} / {at[k][1]['value']:.3f}" if k in at else "-" for k in ks
            ]
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["![accuracy vs N](accuracy_vs_n.png)", "", "![speed](speed.png)", ""]
    if report["sandbox"]:
        lines += ["## Code sandbox on this machine", ""]
        lines += [f"- {k}: {v}" for k, v in report["sandbox"].items()] + [""]
    lines += ["## Definitions", ""] + [f"- {k}: {v}" for k, v in report["definitions"].items()]
    return "\n".join(lines) + "\n"


MARKERS = "osD^vP*X"


def _styles(report: dict) -> dict[str, tuple[str, str, float]]:
    """One (color, marker, line width) per method, the same in every panel. Earlier methods
    draw wider lines, so that a later method's equal curve leaves them visible."""
    methods = sorted({r["method"] for r in report["runs"]})
    return {
        m: (f"C{i}", MARKERS[i % len(MARKERS)], 1.5 + 1.5 * (len(methods) - 1 - i))
        for i, m in enumerate(methods)
    }


def _shifts(count: int) -> list[float]:
    """Factors on k (a few percent, on a log axis) that set `count` equal curves side by
    side, so that their markers and intervals do not hide each other."""
    return [2 ** (0.05 * (j - (count - 1) / 2)) for j in range(count)]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(report: dict, path: Path) -> None:
    """maj@k (solid, with its interval) and pass@k (dashed, hollow markers) against k, one
    panel per task; each method has its own color, marker and line width, and each curve a
    small horizontal offset."""
    plt = _pyplot()
    styles = _styles(report)
    tasks = sorted({r["task"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        runs = [x for x in report["runs"] if x["task"] == task]
        ks: set[int] = set()
        shifts = _shifts(2 * len(runs))
        for i, r in enumerate(runs):
            c = r["metrics"]["curve"]
            color, marker, width = styles[r["method"]]
            ks.update(c["k"])
            maj = c["maj@k"]
            ax.errorbar(
                [k * shifts[2 * i] for k in c["k"]],
                [e["value"] for e in maj],
                yerr=[[e["value"] - e["low"] for e in maj], [e["high"] - e["value"] for e in maj]],
                fmt="-",
                marker=marker,
                color=color,
                linewidth=width,
                capsize=3,
                label=f"{r['method']} maj@k",
            )
            ax.plot(
                [k * shifts[2 * i + 1] for k in c["k"]],
                [e["value"] for e in c["pass@k"]],
                "--",
                marker=marker,
                markerfacecolor="none",
                color=color,
                linewidth=width,
                label=f"{r['method']} pass@k",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ks), [str(k) for k in sorted(ks)])
        ax.set_ylim(-0.04, 1.04)
        ax.set_title(f"{TITLES.get(task, task)}\n{caption(runs)}", fontsize=9)
        ax.set_xlabel("trajectories k")
        ax.set_ylabel("accuracy (maj@k solid, pass@k dashed)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speed(report: dict, path: Path) -> None:
    """tokens/s and acceptance length (with its interval) of every (task, method) run; a line
    at 1.0 marks plain decoding's acceptance length."""
    plt = _pyplot()
    styles = _styles(report)
    runs = report["runs"]
    labels = [f"{r['task']}\n{r['method']}" for r in runs]
    colors = [styles[r["method"]][0] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(runs) + 4), 4.6))
    x = range(len(runs))
    for key, shift, hatch, label in (
        ("tokens_per_s", -0.2, "//", "whole wall (setup included)"),
        ("decode_tokens_per_s", 0.2, "", "decoding alone"),
    ):
        tps = [r["speed"][key] or 0.0 for r in runs]
        axes[0].bar([i + shift for i in x], tps, 0.4, color=colors, hatch=hatch, label=label)
    axes[0].set_xticks(list(x), labels)
    axes[0].legend(fontsize=7)
    axes[0].set_ylabel("tokens/s (new tokens / s)")
    cross = any(r["speed_vs_plain"]["basis"] == "cross-run" for r in runs)
    axes[0].set_title("tokens/s" + " (cross-run: measured apart)" * cross, fontsize=10)
    known = [i for i, r in enumerate(runs) if r["metrics"]["acceptance_length"]]
    est = [runs[i]["metrics"]["acceptance_length"] for i in known]
    err = [[e["value"] - e["low"] for e in est], [e["high"] - e["value"] for e in est]]
    axes[1].bar(
        known, [e["value"] for e in est], yerr=err, capsize=4, color=[colors[i] for i in known]
    )
    for i in sorted(set(x) - set(known)):  # an endpoint's runs: no counters, no bar
        axes[1].text(i, 0.05, "unknown", ha="center", rotation=90, fontsize=8)
    axes[1].set_xticks(list(x), labels)
    axes[1].set_xlim(-0.6, len(runs) - 0.4)
    axes[1].axhline(1.0, color="black", linestyle=":", linewidth=1, label="plain decoding (1.0)")
    axes[1].set_ylabel("committed tokens per target forward")
    axes[1].set_title("acceptance length", fontsize=10)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(caption(runs), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stderr(e: dict) -> float:
    """A standard error read off a 95% interval (what lm-eval's `*_stderr` fields hold)."""
    return (e["high"] - e["low"]) / (2 * 1.96)


def lm_eval_results(report: dict) -> dict[str, dict]:
    """Per run, its lm-eval task name (the task as the user typed it, `gpqa_diamond` say, or
    that and `_<method>` where one task ran with several methods) and its `results` entry in
    lm-eval's `"<metric>,<filter>"` keys: `exact_match` is pass@1; maj@N and pass@N keep
    their names."""
    methods = Counter(r["task"] for r in report["runs"])
    out = {}
    for r in report["runs"]:
        typed = r.get("lm_eval_task") or r["task"]
        name = typed if methods[r["task"]] == 1 else f"{typed}_{r['method']}"
        m, n = r["metrics"], r["metrics"]["n"]
        entry = {"alias": name}
        for key, metric in (
            ("exact_match", "pass@1"),
            (f"maj@{n}", "maj@n"),
            (f"pass@{n}", "pass@n"),
        ):
            entry[f"{key},none"] = m[metric]["value"]
            entry[f"{key}_stderr,none"] = _stderr(m[metric])
        out[name] = {"run": r, "results": entry}
    return out


def write_lm_eval(out: Path, report: dict) -> list[Path]:
    """lm-eval's output layout beside our report, for tools that read it:
    `lm-eval/<model>/results_<time>.json` and, for runs with `--log-samples`,
    `samples_<task>_<time>.jsonl` (one line per item: its trajectories as `resps`, the
    extracted answers as `filtered_resps`, pass@1 as `exact_match`)."""
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    runs = lm_eval_results(report)
    models = sorted({r["model"] for r in report["runs"]})
    folder = out / "lm-eval" / "__".join(m.replace("/", "__") for m in models)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"results_{stamp}.json"]
    paths[0].write_text(json.dumps(_lm_eval_summary(runs, models), indent=1), encoding="utf-8")
    for name, v in runs.items():
        items: dict[str, list[dict]] = {}
        for row in read_rows(out / v["run"]["task"] / v["run"]["method"] / "samples.jsonl"):
            items.setdefault(row["id"], []).append(row)
        if not items:
            continue
        path = folder / f"samples_{name}_{stamp}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for doc_id, (item, rows) in enumerate(items.items()):
                f.write(json.dumps(_lm_eval_sample(doc_id, item, rows)) + "\n")
        paths.append(path)
    return paths


def _lm_eval_summary(runs: dict[str, dict], models: list[str]) -> dict:
    """lm-eval's `results_<time>.json` of the runs (`lm_eval_results`)."""
    return {
        "results": {name: v["results"] for name, v in runs.items()},
        "versions": {name: "tts-service" for name in runs},
        "n-shot": {name: 0 for name in runs},
        "higher_is_better": {
            name: {k.split(",")[0]: True for k in v["results"] if "stderr" not in k and "," in k}
            for name, v in runs.items()
        },
        "n-samples": {
            name: {
                "original": v["run"]["metrics"]["items"],
                "effective": v["run"]["metrics"]["items"],
            }
            for name, v in runs.items()
        },
        "config": {
            "model": "tts-service",
            "model_args": "; ".join(
                f"{name}: model={v['run']['model']},method={v['run']['method']},"
                f"n={v['run']['metrics']['n']}"
                for name, v in runs.items()
            ),
        },
        "model_name": ", ".join(models),
        "date": time.time(),
    }


def _lm_eval_sample(doc_id: int, item: str, rows: list[dict]) -> dict:
    """One item's line of lm-eval's samples file, from its trajectories' sample rows (sorted
    here by index)."""
    rows.sort(key=lambda t: t["index"])
    return {
        "doc_id": doc_id,
        "doc": {"id": item, "prompt": rows[0]["prompt"]},
        "target": rows[0]["reference"],
        "resps": [[t["text"] for t in rows]],
        "filtered_resps": [t["answer"] for t in rows],
        "filter": "none",
        "metrics": ["exact_match"],
        "exact_match": sum(bool(t["correct"]) for t in rows) / len(rows),
    }


def write(out: Path) -> list[Path]:
    """Write the report files into `out`, and lm-eval's layout under `out/lm-eval/`; returns
    their paths (none if nothing is graded)."""
    report = build(out)
    if not report["runs"]:
        return []
    paths = [out / n for n in ("report.json", "report.md", "accuracy_vs_n.png", "speed.png")]
    paths[0].write_text(json.dumps(report, indent=1), encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    plot_accuracy(report, paths[2])
    plot_speed(report, paths[3])
    return paths + write_lm_eval(out, report)
