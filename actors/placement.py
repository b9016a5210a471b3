"""How many GPUs one generator replica needs, and how Ray and accelerate are told about it.

The arithmetic (`plan_placement`, `count_params_from_config`) is pure so it can be checked on a
box without GPUs; `plan_gpu_replicas` applies it to a job's config, reading the model's
transformers config (never its weights) and torch's dtype sizes, lazily. The Ray side
(`create_placement_groups`, `scheduling_strategy`) works against Ray's *declared* resources, so
`ray.init(num_gpus=8)` on a CPU box exercises it for real. `ray` is imported lazily: planning
must not pay for (or depend on) a Ray import, and nothing here touches CUDA at import time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tts_service.config import ModelConfig
    from tts_service.schemas import JobConfig

# Fraction of a GPU's memory we let the model (weights + KV cache) use. The rest is for the CUDA
# context, cuBLAS workspaces and allocator fragmentation, which do not show up in any estimate.
USABLE_GPU_FRACTION = 0.9

_GIB = 2**30
_MIB = 2**20
_KIB = 2**10


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested replicas: what was asked and what it has."""


@dataclass(frozen=True)
class PlacementPlan:
    """One replica's shape, decided once on the driver and handed to every replica.

    `max_memory` is keyed like accelerate expects: local GPU indices (0..gpus_per_replica-1, as
    seen inside the actor after Ray narrows CUDA_VISIBLE_DEVICES) plus "cpu". Treat it as
    read-only; `sharded_device_map_kwargs` hands out copies because accelerate mutates it.
    """

    gpus_per_replica: int
    num_replicas: int
    bytes_per_replica: int  # weights + KV headroom estimate
    max_memory: dict[int | str, str]
    reason: str


def _format_bytes(num_bytes: float, round_up: bool) -> str:
    """A size string accelerate's `convert_file_size_to_int` parses, e.g. "61.49GiB".

    Rounded to 0.01 of the unit: down for GPU budgets (never promise more than is there), up for
    the CPU budget (never make the weights miss it by a rounding error).
    """
    unit, name = (_GIB, "GiB") if num_bytes >= _GIB else (_MIB, "MiB")
    if num_bytes < _MIB:
        unit, name = _KIB, "KiB"
    scaled = num_bytes / unit * 100
    hundredths = math.ceil(scaled) if round_up else math.floor(scaled)
    return f"{hundredths / 100:.2f}{name}"


def plan_placement(
    num_params: int,
    dtype_bytes: int,
    gpu_memory_bytes: int,
    num_gpus: int,
    kv_headroom: float = 0.3,
    max_gpus_per_replica: int = 8,
) -> PlacementPlan:
    """Pick the smallest power-of-two GPU count that holds the weights plus KV headroom.

    Smallest, because every extra GPU in a replica is a GPU not running another best-of-N
    replica, and sharding adds cross-GPU hops per layer. Power of two, because tensor/pipeline
    splits (heads, layers) divide evenly over 1, 2, 4, 8 and nodes come in those sizes.
    `kv_headroom` is the KV cache (and activations) as a fraction of the weights; best-of-N
    keeps N sequences' caches alive, so the default is generous.

    Raises ValueError if the model does not fit in `max_gpus_per_replica` GPUs or in the
    `num_gpus` available. `num_gpus == 0` plans one CPU replica.
    """
    _check_placement_args(num_params, dtype_bytes, num_gpus, kv_headroom, max_gpus_per_replica)
    weights = num_params * dtype_bytes
    need = math.ceil(weights * (1 + kv_headroom))
    if num_gpus == 0:
        return _cpu_plan(weights, need, kv_headroom)

    if gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes must be positive, got {gpu_memory_bytes}")
    usable = USABLE_GPU_FRACTION * gpu_memory_bytes
    described = (
        f"{num_params / 1e9:.1f}B params x {dtype_bytes} B = {weights / 1e9:.1f} GB weights, "
        f"+{kv_headroom:.0%} KV headroom = {need / 1e9:.1f} GB; "
        f"{usable / 1e9:.1f} GB usable per GPU ({USABLE_GPU_FRACTION:.0%} of "
        f"{gpu_memory_bytes / 1e9:.1f} GB)"
    )
    gpus = _gpus_per_replica(need, usable, num_gpus, max_gpus_per_replica, described)
    num_replicas = num_gpus // gpus
    return PlacementPlan(
        gpus_per_replica=gpus,
        num_replicas=num_replicas,
        bytes_per_replica=need,
        max_memory=_device_map_budget(usable, weights * kv_headroom, gpus),
        reason=f"{described} -> {gpus} GPU(s) per replica, {num_replicas} replica(s) "
        f"on {num_gpus} GPU(s)",
    )


def _check_placement_args(
    num_params: int, dtype_bytes: int, num_gpus: int, kv_headroom: float, max_gpus_per_replica: int
) -> None:
    """`plan_placement`'s arguments, before any arithmetic: ValueError names the bad one."""
    if num_params <= 0 or dtype_bytes <= 0:
        raise ValueError(
            f"num_params and dtype_bytes must be positive: {num_params}, {dtype_bytes}"
        )
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if kv_headroom < 0:
        raise ValueError(f"kv_headroom must be >= 0, got {kv_headroom}")
    if max_gpus_per_replica < 1:
        raise ValueError(f"max_gpus_per_replica must be >= 1, got {max_gpus_per_replica}")


def _cpu_plan(weights: int, need: int, kv_headroom: float) -> PlacementPlan:
    """One replica in host memory, its CPU budget the weights plus KV headroom (`need`)."""
    return PlacementPlan(
        gpus_per_replica=0,
        num_replicas=1,
        bytes_per_replica=need,
        max_memory={"cpu": _format_bytes(need, round_up=True)},
        reason=(
            f"CPU only (no GPUs): one replica in host memory, "
            f"{weights / 1e9:.1f} GB weights + {kv_headroom:.0%} KV headroom"
        ),
    )


def _gpus_per_replica(
    need: int, usable: float, num_gpus: int, max_gpus_per_replica: int, described: str
) -> int:
    """The smallest power of two of GPUs whose `usable` bytes each hold `need`; ValueError
    (`described` says why) if that is more than `max_gpus_per_replica` or than `num_gpus`."""
    min_gpus = math.ceil(need / usable)
    gpus = 1 << (min_gpus - 1).bit_length()  # next power of two >= min_gpus
    if gpus > max_gpus_per_replica:
        raise ValueError(
            f"model does not fit: {described}; it needs {gpus} GPUs per replica "
            f"(at least {min_gpus}), more than max_gpus_per_replica={max_gpus_per_replica}"
        )
    if num_gpus // gpus < 1:
        raise ValueError(
            f"model does not fit: {described}; it needs {gpus} GPUs per replica "
            f"but only {num_gpus} are available"
        )
    return gpus


def _device_map_budget(usable: float, kv_bytes: float, gpus: int) -> dict[int | str, str]:
    """accelerate's `max_memory` for a replica of `gpus` GPUs whose KV headroom is `kv_bytes`.

    Per-GPU weight budget: usable memory minus this GPU's even share of the KV headroom. Because
    gpus * usable >= need, this is >= weights / gpus, so an even split fits with slack for
    layer granularity, and however accelerate splits it, each GPU keeps its KV share free.
    "cpu": 0 - a replica that quietly spills layers to host memory runs orders of magnitude
    slower; failing the load is better than that.
    """
    weight_budget = usable - kv_bytes / gpus
    max_memory: dict[int | str, str] = {
        i: _format_bytes(weight_budget, round_up=False) for i in range(gpus)
    }
    max_memory["cpu"] = "0GiB"
    return max_memory


TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)  # ranks of one replica: one node's GPUs, dividing heads


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_heads(config: Any) -> tuple[int, int]:
    """(attention heads, KV heads) of a transformers config (GQA: fewer KV heads)."""
    text = _text_config(config)
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def kv_cache_bytes(config: Any, rows: int, tokens: int, dtype_bytes: int) -> int:
    """The KV cache of `rows` sequences of `tokens` tokens each: keys and values of every
    layer's KV heads (GQA shares them), at the model's dtype."""
    heads, kv_heads = attention_heads(config)
    config = _text_config(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes * rows * tokens


def plan_tensor_parallel(
    num_params: int,
    dtype_bytes: int,
    kv_bytes: int,
    gpu_memory_bytes: int,
    num_gpus: int,
    heads: tuple[int, int],
) -> PlacementPlan:
    """The smallest tensor-parallel rank count G in 1, 2, 4, 8 whose GPUs hold the weights
    plus the KV cache, each rank a 1/G shard of both, and that divides the (attention, KV)
    `heads` (every rank holds whole heads); one GPU per rank, as many replicas as fit.

    Smallest, because every extra rank is a GPU not running another best-of-N replica and adds
    an all-reduce per layer. Raises ValueError if no size fits or the cluster has too few GPUs.
    """
    if num_params <= 0 or dtype_bytes <= 0 or kv_bytes < 0:
        raise ValueError(f"sizes must be positive: {num_params}, {dtype_bytes}, {kv_bytes}")
    if gpu_memory_bytes <= 0 or num_gpus < 1:
        raise ValueError(f"a GPU plan needs GPUs: {num_gpus} of {gpu_memory_bytes} bytes")
    weights = num_params * dtype_bytes
    need = weights + kv_bytes
    usable = USABLE_GPU_FRACTION * gpu_memory_bytes
    described = (
        f"{num_params / 1e9:.1f}B params x {dtype_bytes} B = {weights / 1e9:.1f} GB weights "
        f"+ {kv_bytes / 1e9:.1f} GB KV cache = {need / 1e9:.1f} GB; {usable / 1e9:.1f} GB "
        f"usable per GPU ({USABLE_GPU_FRACTION:.0%} of {gpu_memory_bytes / 1e9:.1f} GB)"
    )
    fits = [g for g in TENSOR_PARALLEL_SIZES if need / g <= usable]
    if not fits:
        raise ValueError(
            f"model does not fit: {described}; not even on {TENSOR_PARALLEL_SIZES[-1]} ranks"
        )
    ranks = next((g for g in fits if heads[0] % g == 0 and heads[1] % g == 0), None)
    if ranks is None:
        raise ValueError(
            f"model does not shard: {described}; it needs {fits[0]} ranks, and none of "
            f"{', '.join(map(str, fits))} divides its {heads[0]} heads and {heads[1]} KV heads"
        )
    if num_gpus < ranks:
        raise ValueError(
            f"model does not fit: {described}; it needs {ranks} GPUs per replica "
            f"but only {num_gpus} are available"
        )
    replicas = num_gpus // ranks
    return PlacementPlan(
        gpus_per_replica=ranks,
        num_replicas=replicas,
        bytes_per_replica=need,
        max_memory={},
        reason=f"{described} -> {ranks} tensor-parallel rank(s) (a GPU each) per replica, "
        f"{replicas} replica(s) on {num_gpus} GPU(s)",
    )


def count_params_from_config(config: Any) -> int:
    """Estimate a dense decoder's parameter count from its transformers config, without weights.

    An *estimate*: exact for Llama-shaped models (Llama, Mistral, Qwen2/3 without their q/k/v
    biases, SmolLM2), but it ignores architecture extras (MoE experts, q/k norms, extra
    projections). It exists to size placement before anything is downloaded; a few percent off
    is well inside the KV headroom.

        embeddings  vocab * hidden            (x2 if lm_head is not tied)
        attention   q, o: hidden * heads * head_dim; k, v: hidden * kv_heads * head_dim (GQA)
        MLP         3 * hidden * intermediate (gate, up, down)
        norms       2 * hidden per layer + hidden final
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()  # multimodal configs keep the decoder in a sub-config
    vocab = config.vocab_size
    hidden = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = config.intermediate_size
    tied = bool(getattr(config, "tie_word_embeddings", False))

    q_o = 2 * hidden * heads * head_dim
    k_v = 2 * hidden * kv_heads * head_dim
    attention = q_o + k_v
    if getattr(config, "attention_bias", False):
        attention += heads * head_dim + 2 * kv_heads * head_dim + hidden  # q, k, v, o biases
    mlp = 3 * hidden * intermediate
    if getattr(config, "mlp_bias", False):
        mlp += 2 * intermediate + hidden
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return embeddings + layers * per_layer + hidden


PROMPT_TOKENS = 1024  # a prompt's allowance in the KV estimate when max_model_len is unset


def plan_gpu_replicas(cfg: JobConfig, gpus: int) -> PlacementPlan:
    """The GPU plan of a job's replicas on `gpus` GPUs of `cfg.gpu_memory_gb` each: at most
    `cfg.replicas` of them (all that fit when unset), sized from the model's config alone.

    `sharding: tensor_parallel` (the default): the smallest rank count, at least
    `tensor_parallel`, that holds the weights and the KV cache of `max_rows` rows of
    `max_model_len` tokens (else `max_new_tokens` + PROMPT_TOKENS) and divides the heads.
    `device_map`: a replica's layers spread over its GPUs (weights + 30% headroom).

    Raises:
        PlacementError: the model does not fit the GPUs (the planner's reason, chained).
    """
    dtype_bytes, config = _model_shape(cfg.model)
    params = count_params_from_config(config)
    memory = int(cfg.gpu_memory_gb * 1024**3)
    try:
        if cfg.sharding == "device_map":
            plan = plan_placement(params, dtype_bytes, memory, gpus)
        else:
            heads = attention_heads(config)
            kv = kv_cache_bytes(config, *_kv_rows_and_tokens(cfg), dtype_bytes)
            plan = plan_tensor_parallel(params, dtype_bytes, kv, memory, gpus, heads)
            plan = _at_least(plan, cfg.tensor_parallel, gpus)
    except ValueError as e:  # the model does not fit these GPUs
        raise PlacementError(str(e)) from e
    replicas = min(cfg.replicas or plan.num_replicas, plan.num_replicas)
    return replace(plan, num_replicas=replicas)


def _model_shape(model: ModelConfig) -> tuple[int, Any]:
    """(bytes per parameter, transformers config) of `model`, read without its weights."""
    import torch
    from transformers import AutoConfig

    from tts_service.models import model_source

    dtype = torch.bfloat16 if model.dtype == "auto" else getattr(torch, model.dtype)
    dtype_bytes = torch.finfo(dtype).bits // 8
    return dtype_bytes, AutoConfig.from_pretrained(model_source(model))


def _kv_rows_and_tokens(cfg: JobConfig) -> tuple[int, int]:
    """The KV cache a replica plans for: `max_rows` rows (else the CUDA default) of
    `max_model_len` tokens (else `max_new_tokens` + PROMPT_TOKENS)."""
    from tts_service.config import default_max_rows

    rows = cfg.max_rows or default_max_rows("cuda")
    tokens = cfg.model.max_model_len or cfg.sampling.max_new_tokens + PROMPT_TOKENS
    return rows, tokens


def _at_least(plan: PlacementPlan, ranks: int, gpus: int) -> PlacementPlan:
    """The plan with at least the `ranks` the user asked for (more ranks: faster forwards)."""
    if ranks <= plan.gpus_per_replica:
        return plan
    if ranks > gpus:
        raise ValueError(f"tensor_parallel={ranks} needs {ranks} GPUs; the cluster has {gpus}")
    return replace(
        plan,
        gpus_per_replica=ranks,
        num_replicas=gpus // ranks,
        reason=f"{plan.reason}; tensor_parallel={ranks} asked: {gpus // ranks} replica(s)",
    )


STATUS_EVERY_S = 10.0  # a waiting placement says so this often


def create_placement_groups(
    plan: PlacementPlan,
    cpus_per_replica: float = 0.5,
    timeout_s: float = 30,
    status: Callable[[str], None] | None = None,
) -> list[PlacementGroup]:
    """Reserve one STRICT_PACK placement group per replica, all or nothing.

    One bundle holds all of a replica's GPUs, so Ray must find them on one node (sharding a
    model across nodes would put every layer boundary on the network). All groups are created
    first and then awaited against one shared deadline, so N replicas wait at most `timeout_s`
    in total: a busy cluster's queue (another job holds the resources), with a `status` line
    every `STATUS_EVERY_S` (default: printed, so a Ray job's log shows it). If any is not ready
    by then, every group created here is removed and PlacementError says what is missing: what
    no node of the cluster has (an autoscaler could still add it, so that waits too), or what
    other work holds. A half-placed fleet would hold resources that nothing uses.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle: dict[str, float] = {}
    if plan.gpus_per_replica > 0:
        bundle["GPU"] = plan.gpus_per_replica
    if cpus_per_replica > 0:
        bundle["CPU"] = cpus_per_replica
    if not bundle:
        raise ValueError("a CPU plan needs cpus_per_replica > 0: the bundle would be empty")
    say = status or (lambda line: print(line, flush=True))

    free = ray.available_resources()  # before this plan's own reservations
    groups: list[PlacementGroup] = []
    try:
        for _ in range(plan.num_replicas):
            groups.append(placement_group([dict(bundle)], strategy="STRICT_PACK"))
        start = time.monotonic()
        deadline = start + timeout_s
        for index, group in enumerate(groups):
            while not group.wait(min(STATUS_EVERY_S, max(0.0, deadline - time.monotonic()))):
                waited = time.monotonic() - start
                if time.monotonic() >= deadline:
                    asked = {k: v * plan.num_replicas for k, v in bundle.items()}
                    raise PlacementError(
                        f"placement group {index + 1} of {plan.num_replicas} (bundle {bundle}, "
                        f"STRICT_PACK) was not placed within {timeout_s:g}s: asked for "
                        f"{_amounts(asked)} in all; the cluster has "
                        f"{_amounts(ray.cluster_resources(), bundle)} "
                        f"(free: {_amounts(free, bundle)}); {_missing(bundle, asked)}. "
                        f"All {len(groups)} groups created for this plan were removed."
                    )
                say(
                    f"[placement] waiting for the cluster: {index} of {plan.num_replicas} "
                    f"group(s) placed (bundle {_amounts(bundle)}); free now "
                    f"{_amounts(ray.available_resources(), bundle)}; {waited:.0f} s of "
                    f"{timeout_s:g} s (placement_timeout_s)"
                )
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    return groups


def check_placeable(
    bundles: list[dict[str, float]], timeout_s: float, stop: Callable[[], bool]
) -> bool:
    """Whether Ray places `bundles` on one node (STRICT_PACK) within `timeout_s`: reserved,
    then released (a deployment that follows reserves its own). Checked every second, so a
    caller told to stop (`stop()` true) returns False within one.

    Raises:
        PlacementError: not placed in time: what was asked and what the cluster has.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy="STRICT_PACK")
    try:
        deadline = time.monotonic() + timeout_s
        while not group.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if stop():
                return False
            if time.monotonic() >= deadline:
                asked = {k: sum(b.get(k, 0) for b in bundles) for k in bundles[0]}
                raise PlacementError(
                    f"{len(bundles)} bundles of {_amounts(bundles[0])} on one node "
                    f"(STRICT_PACK) were not placed within {timeout_s:g} s; the cluster has "
                    f"{_amounts(ray.cluster_resources(), asked)}; {_missing(asked, asked)}"
                )
        return True
    finally:
        remove_placement_group(group)


def _missing(bundle: dict[str, float], asked: dict[str, float]) -> str:
    """What keeps the plan from placing: a resource no node has enough of for one bundle or
    the cluster lacks in total (missing whatever runs), else what other work holds."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    short = [
        f"no node has {k} {v:g} (the largest has {max((n.get(k, 0) for n in nodes), default=0):g})"
        for k, v in bundle.items()
        if not any(n.get(k, 0) >= v for n in nodes)
    ]
    short += [
        f"the cluster has {k} {total.get(k, 0):g} of {v:g}"
        for k, v in asked.items()
        if total.get(k, 0) < v
    ]
    if short:
        return "missing however long it waits, unless nodes join: " + "; ".join(short)
    return "the cluster could hold it: other work holds the rest (retry, or a longer timeout)"


def _amounts(resources: dict[str, float], keys: dict | None = None) -> str:
    """`CPU 2, GPU 0`: the resources a bundle asks for, leaving out Ray's internal ones."""
    return ", ".join(f"{k} {resources.get(k, 0):g}" for k in sorted(keys or resources))


def scheduling_strategy(pg: PlacementGroup) -> PlacementGroupSchedulingStrategy:
    """Schedule an actor into the group's single bundle; its child tasks stay in the group too,
    so anything the replica spawns draws on the replica's reservation, not the free pool."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=0,
        placement_group_capture_child_tasks=True,
    )


def sharded_device_map_kwargs(plan: PlacementPlan, device_type: str) -> dict[str, Any]:
    """`from_pretrained` kwargs that shard the model over exactly the replica's visible GPUs.

    Inside the actor Ray has narrowed CUDA_VISIBLE_DEVICES to the replica's GPUs, so local
    indices 0..g-1 in `max_memory` are exactly those GPUs. One GPU or CPU needs no device map
    (`{}`; the caller moves the model with `.to(device)` as usual). `device_type` is a torch
    device string ("cpu", "cuda", "cuda:0"); resolve "auto" before calling.
    """
    kind = device_type.split(":", 1)[0]
    if kind == "auto":
        raise ValueError("resolve device 'auto' to 'cuda' or 'cpu' before asking for a device map")
    if kind == "cpu" or plan.gpus_per_replica <= 1:
        return {}
    if kind != "cuda":
        raise ValueError(
            f"a {plan.gpus_per_replica}-GPU plan shards over CUDA devices, not {device_type!r}"
        )
    # A copy: accelerate converts the size strings in place.
    return {"device_map": "auto", "max_memory": dict(plan.max_memory)}
