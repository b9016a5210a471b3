"""`tts generate --tensor-parallel 2`: a 2-rank Ray replica on CPU (gloo) prints the JSON one
process prints, token for token (greedy, fp32)."""

from __future__ import annotations

import json

from tts_service.cli import main


def test_tensor_parallel_generate_prints_what_one_process_prints(ray_local, tiny_model_dir, capsys):
    argv = [
        "generate", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
        "--method", "pld", "--temperature", "0", "--max-new-tokens", "16", "--json",
        "the cat sat on the mat and the cat sat on the",
    ]  # fmt: skip
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--tensor-parallel", "2"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert sharded.keys() == single.keys()
    assert sharded["token_ids"] == single["token_ids"] and sharded["text"] == single["text"]
    assert len(sharded["token_ids"]) == 16


def test_gt_sized_methods_run_on_ranks_with_the_fixed_cost(ray_local, tiny_model_dir, capsys):
    """Rank 0 prices tree tokens by the fixed GPU-like curve (its ranks cannot mirror a cost
    measurement): other trees than one process's, the same greedy tokens."""
    argv = [
        "generate", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
        "--method", "stand-dyn", "--temperature", "0", "--max-new-tokens", "16", "--json",
        "the cat sat on the mat and the cat sat on the",
    ]  # fmt: skip
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--tensor-parallel", "2"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert sharded["token_ids"] == single["token_ids"]
