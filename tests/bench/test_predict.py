"""`bench/predict.py`: the roofline reproduces its anchor, obeys the physics it models, and
`bench.device --predict` writes its records (or exits 2 without the host benchmark)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from bench import device
from bench import predict as pr

ROOT = Path(__file__).resolve().parents[2]
EFF = pr.fit_efficiency()
H100 = pr.GPUS["H100"]
# a host benchmark's shape (bench.host: rows x nodes, plain at nodes 0 only), made-up times
HOST = [
    {"method": m, "rows": r, "nodes": n, "host_ms_per_step": base + 0.05 * r + 0.01 * n * r}
    for m, base in (("plain", 1.0), ("stand", 2.0), ("stand-dyn", 3.0))
    for r in (1, 16, 64)
    for n in ((0,) if m == "plain" else (0, 8, 32))
]
ACCEPTANCE = {
    m: {str(n): round(1 + scale * n**0.3, 3) for n in (1, 2, 4, 8, 16, 32, 64)}
    for m, scale in (("stand", 0.5), ("stand-dyn", 0.6))
}
KEYS = {"model", "gpus", "rows", "context", "method", "tokens_per_s", "nodes", "speedup"}


def test_the_fitted_roofline_reproduces_its_anchor():
    step = pr.step_time(pr.SHAPES["llama-3.1-8b"], H100, 1, 1, 1, pr.ANCHOR_CONTEXT, EFF)
    assert 1 / step == pytest.approx(pr.ANCHOR_TOKENS_PER_S, abs=0.5)
    assert 0.5 < EFF < 1.0  # a fraction of the bandwidth bound, as every engine reaches


def _published(cls, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int):
    return cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("qwen2.5-7b", device.ARCHITECTURES["qwen2.5-7b"]()),
        ("llama-3.1-8b", device.ARCHITECTURES["llama-3.1-8b"]()),
        ("qwen2.5-14b", _published(Qwen2Config, 152064, 5120, 13824, 48, 40, 8)),
        ("qwen2.5-32b", _published(Qwen2Config, 152064, 5120, 27648, 64, 40, 8)),
        ("llama-3.1-70b", _published(LlamaConfig, 128256, 8192, 28672, 80, 64, 8)),
    ],
)
def test_shapes_count_the_parameters_transformers_builds(name, cfg):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert pr.SHAPES[name] == pr.Shape.from_config(name, cfg)
    assert pr.SHAPES[name].parameters() == sum(p.numel() for p in model.parameters())


def test_qwen2_7b_keeps_56_kib_of_kv_per_token():
    assert pr.SHAPES["qwen2.5-7b"].kv_bytes_per_token() == 56 * 1024


@pytest.mark.parametrize("gpus", pr.GPU_COUNTS)
@pytest.mark.parametrize("context", [512, *pr.CONTEXTS])
@pytest.mark.parametrize("tokens_per_row", [1, 17])
def test_more_rows_never_less_total_throughput(gpus, context, tokens_per_row):
    for shape in pr.SHAPES.values():
        rates = [
            rows
            * tokens_per_row
            / pr.step_time(shape, H100, gpus, rows, tokens_per_row, context, EFF)
            for rows in range(1, 257)
        ]
        assert all(b >= a * (1 - 1e-12) for a, b in zip(rates, rates[1:], strict=False)), shape


@pytest.mark.parametrize("gpus", pr.GPU_COUNTS)
@pytest.mark.parametrize(("rows", "tokens_per_row"), [(1, 1), (16, 1), (16, 65), (64, 9)])
@pytest.mark.parametrize("context", [512, *pr.CONTEXTS])
def test_more_weight_bytes_never_faster(gpus, rows, tokens_per_row, context):
    times = [
        pr.step_time(pr.SHAPES[m], H100, gpus, rows, tokens_per_row, context, EFF)
        for m in pr.MODELS
    ]
    assert times == sorted(times) and len(set(times)) == len(times)
    shape = pr.SHAPES["qwen2.5-7b"]
    wider = [dataclasses.replace(shape, intermediate=i) for i in (18944, 20000, 40000, 80000)]
    times = [pr.step_time(s, H100, gpus, rows, tokens_per_row, context, EFF) for s in wider]
    assert times == sorted(times)


def test_more_tokens_per_row_never_a_shorter_step():
    for shape in pr.SHAPES.values():
        for gpus in pr.GPU_COUNTS:
            for rows in (1, 16, 64):
                times = [pr.step_time(shape, H100, gpus, rows, t, 4096, EFF) for t in range(1, 130)]
                assert times == sorted(times)


def test_host_time_is_linear_between_measurements_and_clamped_outside():
    host = pr.HostTable.from_records(HOST)
    assert host.ms("stand", 16, 8) == pytest.approx(2.0 + 0.8 + 1.28)
    assert host.ms("stand", 16, 4) == pytest.approx((host.ms("stand", 16, 0) + 2.0 + 2.08) / 2)
    mid = (host.ms("stand", 16, 8) + host.ms("stand", 64, 8)) / 2
    assert host.ms("stand", 40, 8) == pytest.approx(mid)
    assert host.ms("stand", 256, 64) == host.ms("stand", 64, 32)  # clamped
    assert host.ms("plain", 16, 32) == host.ms("plain", 16, 0)


def test_the_allocator_picks_the_fastest_node_count_and_auto_the_best_of_plain_and_it():
    host, acc = pr.HostTable.from_records(HOST), pr.read_acceptance_data(ACCEPTANCE)
    cfg = pr.Config(pr.SHAPES["qwen2.5-7b"], H100, 1, 16, 4096)
    recs = {r["method"]: r for r in pr.predict_config(cfg, acc, host, EFF)}
    for method in pr.METHODS:
        every = [pr.method_record(cfg, method, 0, 1.0, host, EFF)] + [
            pr.method_record(cfg, method, n, a, host, EFF) for n, a in acc[method].items()
        ]
        assert recs[method]["tokens_per_s"] == max(r["tokens_per_s"] for r in every)
    assert recs["auto"]["tokens_per_s"] == max(
        recs["plain"]["tokens_per_s"], recs[pr.AUTO]["tokens_per_s"]
    )
    assert recs["plain"]["speedup"] == 1.0 and recs["plain"]["nodes"] == 0
    # with host time dominating, speculation still pays and auto drafts
    assert recs["auto"]["via"] == pr.AUTO and recs["auto"]["nodes"] > 0


def test_70b_in_bf16_does_not_fit_one_h100():
    fit, skip = pr.configs(H100, ["llama-3.1-70b"], [1, 8])
    assert {c.gpus for c in skip} >= {1} and {c.gpus for c in fit} == {8}


def _predict(tmp_path: Path, host: Path) -> subprocess.CompletedProcess:
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps(ACCEPTANCE))
    cmd = [sys.executable, "-m", "bench.device", "--predict", "--host-json", str(host)]
    cmd += ["--acceptance", str(acceptance), "--json", str(tmp_path / "predicted.json")]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_predict_writes_a_record_per_model_gpus_rows_context_and_method(tmp_path):
    host = tmp_path / "host.json"
    host.write_text(json.dumps(HOST))
    res = _predict(tmp_path, host)
    assert res.returncode == 0, res.stderr[-3000:]
    records = json.loads((tmp_path / "predicted.json").read_text())
    assert all(r.keys() >= KEYS for r in records)
    cells = {(r["model"], r["gpus"], r["rows"], r["context"]) for r in records}
    methods = {(r["model"], r["gpus"], r["rows"], r["context"], r["method"]) for r in records}
    assert methods == {(*c, m) for c in cells for m in ("plain", "stand", "stand-dyn", "auto")}
    assert ("qwen2.5-7b", 1, 16, 4096) in cells and ("llama-3.1-70b", 8, 64, 16384) in cells
    assert not any(m == "llama-3.1-70b" and g == 1 for m, g, *_ in cells)
    assert "qwen2.5-7b, 1× H100, 16 rows, context 4096: auto" in res.stdout
    assert "| llama-3.1-70b | 8 | 64 | 16384 | " in res.stdout  # the per-configuration table


def test_predict_without_the_host_benchmark_exits_2_saying_so(tmp_path):
    res = _predict(tmp_path, tmp_path / "absent.json")
    assert res.returncode == 2
    assert "no host benchmark at" in res.stderr and "bench.host" in res.stderr
    assert not (tmp_path / "predicted.json").exists()


def test_the_committed_acceptance_table_covers_every_method_and_node_count():
    table = pr.read_acceptance(pr.ACCEPTANCE_JSON)
    for method in pr.METHODS:
        assert set(table[method]) == {n for n in pr.NODE_CANDIDATES if n}
        rates = [table[method][n] for n in sorted(table[method])]
        assert all(a >= 1.0 for a in rates) and rates == sorted(rates)


def test_measured_steps_time_every_record_on_the_device_at_hand():
    torch.set_grad_enabled(False)
    model, _ = device.build_model("tiny", None, "cpu", torch.float32)
    host, acc = pr.HostTable.from_records(HOST), pr.read_acceptance_data(ACCEPTANCE)
    cfg = pr.Config(pr.Shape.from_config("tiny", model.config), H100, 1, 2, 64)
    out = device.measured_steps(model, pr.predict_config(cfg, acc, host, EFF), repeats=1)
    assert [r["method"] for r in out] == ["plain", "stand", "stand-dyn", "auto"]
    assert all(r["measured_step_ms"] > 0 and r["measured_tokens_per_s"] > 0 for r in out)
    assert "| tiny | 2 | 64 | plain |" in device.side_by_side(out)


def test_the_refit_recovers_the_terms_that_made_the_steps():
    """Steps made by known terms (KV at some efficiency, a fixed cost, a cost per token over
    the weights' roofline) give those terms back, and every record its own figure."""
    shape = pr.SHAPES["qwen2.5-7b"]
    truth = pr.StepFit(kv=1.8, fixed_s=2e-3, token_s=4e-6)
    cells = [(r, t, c) for r in (1, 16, 64) for t in (1, 9) for c in (512, 4096)]
    steps = [(r, t, c, truth.step_time(shape, H100, r, t, c)) for r, t, c in cells]
    fit = pr.refit(shape, H100, steps)
    for got, want in zip(fit, truth, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    records = [
        {
            "rows": r,
            "nodes": t - 1,
            "context": c,
            "acceptance_length": 1.5,
            "host_ms": 1.0,
            "measured_step_ms": s * 1e3,
            "measured_tokens_per_s": r * 1.5 / (s + 1e-3),
        }
        for r, t, c, s in steps
    ]
    _, out = device.refitted(records, shape, H100)
    assert all(abs(r["refit_error"]) < 1e-6 for r in out)
    with pytest.raises(ValueError, match="3 measured steps"):
        pr.refit(shape, H100, steps[:2])


def test_a_long_context_is_other_problems_text_before_the_prompt(tmp_path):
    problems = device.read_log(device.LOG, 2, 256, context=3000)
    short = device.read_log(device.LOG, 2, 256)
    for long, plain in zip(problems, short, strict=True):
        assert (
            len(long.prompt_ids) == 3000
            and long.prompt_ids[-len(plain.prompt_ids) :] == plain.prompt_ids
        )
        assert long.responses == plain.responses
    # problem 0's context copies none of its own responses (no 32 tokens of them in a row)
    own = {tuple(r[i : i + 32]) for r in short[0].responses for i in range(len(r) - 31)}
    head = problems[0].prompt_ids[: -len(short[0].prompt_ids)]
    assert not own & {tuple(head[i : i + 32]) for i in range(len(head) - 31)}
