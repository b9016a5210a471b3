"""Placement: the sizing arithmetic, real Ray placement groups on declared (fake) GPUs, and the
accelerate load path on CPU. No GPU needed: `ray.init(num_gpus=8)` declares the resources."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate.utils import convert_file_size_to_int
from transformers import LlamaConfig, LlamaForCausalLM

from actors.placement import (
    USABLE_GPU_FRACTION,
    PlacementPlan,
    count_params_from_config,
    create_placement_groups,
    kv_cache_bytes,
    plan_placement,
    plan_tensor_parallel,
    scheduling_strategy,
    sharded_device_map_kwargs,
)
from tests.conftest import tiny_llama

GB = 10**9
BF16 = 2


# ---------------------------------------------------------------- pure arithmetic


@pytest.mark.parametrize(
    ("billions", "kv_headroom", "gpus_per_replica", "num_replicas"),
    [
        (7, 0.3, 1, 8),  # 14 GB + 30% = 18.2 GB <= 72 GB
        (33, 0.3, 2, 4),  # 66 GB + 30% = 85.8 GB > 72 GB
        (70, 0.3, 4, 2),  # 140 GB + 30% = 182 GB > 2 * 72 GB
        (70, 0.0, 2, 4),  # 140 GB <= 2 * 72 GB
    ],
)
def test_plan_placement_sizes(
    billions: int, kv_headroom: float, gpus_per_replica: int, num_replicas: int
) -> None:
    plan = plan_placement(billions * 10**9, BF16, 80 * GB, 8, kv_headroom=kv_headroom)
    assert plan.gpus_per_replica == gpus_per_replica
    assert plan.num_replicas == num_replicas
    weights = billions * 10**9 * BF16
    assert plan.bytes_per_replica == pytest.approx(weights * (1 + kv_headroom))
    assert set(plan.max_memory) == {*range(gpus_per_replica), "cpu"}
    assert convert_file_size_to_int(plan.max_memory["cpu"]) == 0  # never spill to host memory
    budgets = [convert_file_size_to_int(plan.max_memory[i]) for i in range(gpus_per_replica)]
    assert len(set(budgets)) == 1  # an even split
    # The weights fit split evenly, and each GPU keeps its share of the KV headroom free.
    assert budgets[0] >= weights / gpus_per_replica
    assert budgets[0] <= USABLE_GPU_FRACTION * 80 * GB - weights * kv_headroom / gpus_per_replica
    assert f"{gpus_per_replica} GPU(s) per replica" in plan.reason


def test_plan_placement_7b_in_gib() -> None:
    """A 7B model on 80 GiB cards: the GiB string accelerate will see is what we expect."""
    plan = plan_placement(7 * 10**9, BF16, 80 * 2**30, 8)
    assert (plan.gpus_per_replica, plan.num_replicas) == (1, 8)
    assert plan.max_memory[0].endswith("GiB")
    assert 60 < float(plan.max_memory[0][:-3]) < 72


def test_plan_placement_too_big_for_a_replica() -> None:
    with pytest.raises(ValueError, match=r"does not fit.*needs 16 GPUs per replica"):
        plan_placement(405 * 10**9, BF16, 80 * GB, 8)  # 1053 GB: 15 GPUs -> 16


def test_plan_placement_too_big_for_the_cluster() -> None:
    with pytest.raises(ValueError, match=r"does not fit.*needs 4 GPUs per replica.*only 2"):
        plan_placement(70 * 10**9, BF16, 80 * GB, 2)


def test_plan_placement_cpu_only() -> None:
    plan = plan_placement(135 * 10**6, 4, 0, 0)
    assert (plan.gpus_per_replica, plan.num_replicas) == (0, 1)
    assert "CPU" in plan.reason
    assert set(plan.max_memory) == {"cpu"}
    assert convert_file_size_to_int(plan.max_memory["cpu"]) >= plan.bytes_per_replica


# Llama-2-7B, a 33B with GQA (DeepSeek-Coder-33B's shape) and Llama-2-70B, as declared configs
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "33b": dict(hidden_size=7168, intermediate_size=19200, num_hidden_layers=62,
                num_attention_heads=56, num_key_value_heads=8, vocab_size=32256),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
}  # fmt: skip


def _tensor_parallel_plan(shape: str, rows: int = 64, tokens: int = 1536, gpus: int = 8):
    config = LlamaConfig(**SHAPES[shape])
    kv = kv_cache_bytes(config, rows, tokens, BF16)
    heads = (config.num_attention_heads, config.num_key_value_heads)
    return plan_tensor_parallel(count_params_from_config(config), BF16, kv, 80 * GB, gpus, heads)


@pytest.mark.parametrize(("shape", "ranks"), [("7b", 1), ("33b", 2), ("70b", 4)])
def test_the_tensor_parallel_plan_counts_weights_and_the_kv_cache(shape: str, ranks: int) -> None:
    """64 rows of 512 new + 1024 prompt tokens in bf16 on 80 GB GPUs: 7B (13.5 GB + 51.5 GB of
    KV, no GQA) fits one; 33B (66.5 + 25 GB) needs 2; 70B (138 + 32 GB) needs 4."""
    plan = _tensor_parallel_plan(shape)
    assert (plan.gpus_per_replica, plan.num_replicas) == (ranks, 8 // ranks)
    assert f"{ranks} tensor-parallel rank(s)" in plan.reason and plan.max_memory == {}


def test_the_kv_cache_alone_can_call_for_more_ranks() -> None:
    assert _tensor_parallel_plan("70b", tokens=16384).gpus_per_replica == 8  # 138 + 344 GB
    with pytest.raises(ValueError, match="does not fit.*not even on 8 ranks"):
        _tensor_parallel_plan("70b", tokens=32768)


def test_the_tensor_parallel_plan_divides_the_heads_or_says_so() -> None:
    # 2 GB of weights on 1 GB GPUs: 4 ranks at least; 12 heads and 4 KV heads split in 4
    assert plan_tensor_parallel(10**9, BF16, 0, GB, 8, heads=(12, 4)).gpus_per_replica == 4
    with pytest.raises(ValueError, match="does not shard.*6 heads and 6 KV heads"):
        plan_tensor_parallel(10**9, BF16, 0, GB, 8, heads=(6, 6))


def test_the_tensor_parallel_plan_needs_the_gpus() -> None:
    with pytest.raises(ValueError, match="needs 4 GPUs per replica but only 2"):
        _tensor_parallel_plan("70b", gpus=2)


@pytest.mark.parametrize("tied", [False, True])
def test_count_params_matches_a_real_tiny_llama(tied: bool) -> None:
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA: k and v are a quarter of q
        tie_word_embeddings=tied,
    )
    real = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    estimate = count_params_from_config(config)
    assert estimate == pytest.approx(real, rel=0.01)


# ---------------------------------------------------------------- Ray, 8 declared GPUs


@pytest.fixture(scope="module")
def ray_8_gpus() -> Iterator[None]:
    """A private Ray on 127.0.0.1 with 8 declared GPUs; shut down only if this fixture
    started it."""
    import ray

    from actors.cluster import start_local

    started = False
    if not ray.is_initialized():
        start_local(num_cpus=2, num_gpus=8, object_store_memory=300 * 1024**2)
        started = True
    gpus = ray.cluster_resources().get("GPU", 0)
    assert gpus == 8, f"these tests need a Ray cluster with exactly 8 GPUs; this one has {gpus}"
    yield
    if started:
        ray.shutdown()


def _live_groups() -> set[str]:
    """Ids of placement groups not yet removed (pending or created)."""
    from ray.util import placement_group_table

    return {pg_id for pg_id, row in placement_group_table().items() if row["state"] != "REMOVED"}


def _wait_for_free_gpus(count: float, timeout_s: float = 10) -> float:
    """Freed bundles and dead actors hand their GPUs back asynchronously; poll until they are."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return ray.available_resources().get("GPU", 0)


def _plan(gpus: int, replicas: int) -> PlacementPlan:
    return PlacementPlan(gpus, replicas, 0, {}, "test")


def test_placement_groups_give_each_actor_its_own_gpus(ray_8_gpus: None) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    @ray.remote(num_gpus=2, num_cpus=0)
    class Probe:
        def gpu_ids(self) -> list[int]:
            return [int(i) for i in ray.get_gpu_ids()]

    plan = plan_placement(33 * 10**9, BF16, 80 * GB, 8)
    assert (plan.gpus_per_replica, plan.num_replicas) == (2, 4)
    before = _live_groups()
    groups = create_placement_groups(plan, timeout_s=10)
    actors = []
    try:
        assert len(groups) == 4
        actors = [
            Probe.options(scheduling_strategy=scheduling_strategy(pg)).remote() for pg in groups
        ]
        ids = ray.get([a.gpu_ids.remote() for a in actors], timeout=60)
        for got in ids:
            assert len(got) == 2 and len(set(got)) == 2, ids
        assert sorted(i for got in ids for i in got) == list(range(8)), ids
    finally:
        for actor in actors:
            ray.kill(actor)
        for pg in groups:
            remove_placement_group(pg)
    assert _live_groups() == before
    assert _wait_for_free_gpus(8) == 8


def test_a_group_that_cannot_be_placed_fails_fast_and_leaves_nothing(ray_8_gpus: None) -> None:
    from ray.util.placement_group import remove_placement_group

    assert _wait_for_free_gpus(8) == 8  # the previous test's groups are gone
    before = _live_groups()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not placed within 3s"):
        create_placement_groups(_plan(gpus=2, replicas=5), timeout_s=3)  # 10 GPUs on 8
    assert time.monotonic() - start < 10
    assert _live_groups() == before  # the 4 that could be placed were removed too

    # ...and their GPUs really came back: a full 4 x 2 fleet places at once.
    groups = create_placement_groups(_plan(gpus=2, replicas=4), timeout_s=10)
    try:
        assert len(groups) == 4
        # With all 8 GPUs held, one more 2-GPU replica cannot be placed either.
        with pytest.raises(RuntimeError, match=r"placement group 1 of 1"):
            create_placement_groups(_plan(gpus=2, replicas=1), timeout_s=1)
    finally:
        for pg in groups:
            remove_placement_group(pg)
    assert _live_groups() == before
    assert _wait_for_free_gpus(8) == 8


def test_a_busy_cluster_is_waited_for_and_a_missing_resource_is_named(
    ray_8_gpus: None, monkeypatch
) -> None:
    """Another job holds every GPU: a new plan waits, saying so, and is placed once they are
    freed. A plan no node can ever hold fails after the timeout naming what is missing."""
    from ray.util.placement_group import remove_placement_group

    from actors import placement

    monkeypatch.setattr(placement, "STATUS_EVERY_S", 1.0)

    assert _wait_for_free_gpus(8) == 8
    other = create_placement_groups(_plan(gpus=2, replicas=4), timeout_s=10)  # all 8 GPUs
    lines: list[str] = []
    threading.Timer(4.0, lambda: [remove_placement_group(g) for g in other]).start()
    groups = create_placement_groups(_plan(gpus=2, replicas=2), timeout_s=60, status=lines.append)
    try:
        assert len(groups) == 2 and lines  # it waited, and said so
        assert "waiting for the cluster: 0 of 2 group(s) placed" in lines[0]
        assert "placement_timeout_s" in lines[0]
    finally:
        for pg in groups:
            remove_placement_group(pg)
    with pytest.raises(RuntimeError, match=r"no node has GPU 16 \(the largest has 8\)"):
        create_placement_groups(_plan(gpus=16, replicas=1), timeout_s=1, status=lines.append)
    held = create_placement_groups(_plan(gpus=2, replicas=4), timeout_s=10)
    try:
        with pytest.raises(RuntimeError, match="other work holds the rest"):
            create_placement_groups(_plan(gpus=2, replicas=1), timeout_s=1, status=lines.append)
    finally:
        for pg in held:
            remove_placement_group(pg)
    assert _wait_for_free_gpus(8) == 8


def test_cpu_plan_groups_hold_only_cpu(ray_8_gpus: None) -> None:
    from ray.util import placement_group_table
    from ray.util.placement_group import remove_placement_group

    plan = plan_placement(135 * 10**6, 4, 0, 0)
    groups = create_placement_groups(plan, cpus_per_replica=0.5, timeout_s=10)
    try:
        assert len(groups) == 1
        assert placement_group_table(groups[0])["bundles"] == {0: {"CPU": 0.5}}
    finally:
        for pg in groups:
            remove_placement_group(pg)


# ---------------------------------------------------------------- the sharded-load path, on CPU


def test_sharded_device_map_kwargs() -> None:
    cpu = plan_placement(135 * 10**6, 4, 0, 0)
    one = plan_placement(7 * 10**9, BF16, 80 * GB, 8)
    two = plan_placement(33 * 10**9, BF16, 80 * GB, 8)
    assert sharded_device_map_kwargs(cpu, "cpu") == {}
    assert sharded_device_map_kwargs(one, "cuda") == {}
    assert sharded_device_map_kwargs(one, "cuda:0") == {}
    assert sharded_device_map_kwargs(two, "cpu") == {}
    kwargs = sharded_device_map_kwargs(two, "cuda")
    assert kwargs == {"device_map": "auto", "max_memory": two.max_memory}
    kwargs["max_memory"][0] = 1  # accelerate does this to the dict it is given
    assert two.max_memory[0] != 1
    with pytest.raises(ValueError, match="auto"):
        sharded_device_map_kwargs(two, "auto")
    with pytest.raises(ValueError, match="mps"):
        sharded_device_map_kwargs(two, "mps")


def test_device_mapped_load_on_cpu_gives_the_same_logits(tmp_path: Path) -> None:
    reference = tiny_llama(vocab_size=128, seed=0, dtype=torch.float32)
    config = reference.config
    reference.save_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        want = reference(ids).logits

    plan = plan_placement(count_params_from_config(config), 4, 0, 0)
    assert sharded_device_map_kwargs(plan, "cpu") == {}
    loads = {
        "cpu+1GiB": {"device_map": "cpu", "max_memory": {"cpu": "1GiB"}},
        # The plan's own budget string goes through accelerate's parser and device-map inference.
        "auto+plan": {"device_map": "auto", "max_memory": dict(plan.max_memory)},
    }
    for name, kwargs in loads.items():
        loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **kwargs).eval()
        assert {p.device.type for p in loaded.parameters()} == {"cpu"}, name
        with torch.no_grad():
            got = loaded(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
