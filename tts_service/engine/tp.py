"""Tensor-parallel replicas: every rank holds a shard of every layer and runs every forward.

Sharding is transformers' own (`from_pretrained(..., tp_plan="auto")`, the model family's
`base_model_tp_plan`): column-parallel q/k/v and gate/up projections, row-parallel o_proj and
down_proj followed by an all-reduce, the LM head vocabulary-parallel with its logits gathered,
so every rank sees the full logits. It runs on CPU with gloo as on GPUs with NCCL, over the
default process group. Attention heads and KV heads split across ranks, so each rank's
`StaticKV` holds its own heads (`shards`: the config's KV heads over the ranks); the rank count
must divide both head counts.

Rank 0, the leader, runs the drafters, the store and verification in an ordinary
`BatchDecoder`; the other ranks, the followers, only mirror it. The step protocol: before the
leader's model runs a forward (a prefill or a verify step), and before its cache rewrites
itself (keep the accepted path, compact, rows leaving or joining), it broadcasts the call, its
tensors and its scalars (`Link`); every follower applies the same call to its own shard of the
model and of the cache (`follow`), so every collective inside the forward meets its peers on
every rank. `stop` ends the followers' loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    DistributedConfig,
    DynamicCache,
    PretrainedConfig,
    PreTrainedModel,
)

from tts_service.engine.attention import use_grouped_attention
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.kv import PrefillKV, StaticKV
from tts_service.engine.options import DecoderOptions

_TENSOR = "__tensor__"  # an argument that travels as the i-th broadcast tensor
_PREFILL = "__prefill__"  # a prefill's cache, by the leader's key (each rank has its own)
_STOP = "stop"


def check_ranks(config: PretrainedConfig, ranks: int) -> None:
    """Raise ValueError unless `ranks` divides the model's attention and KV heads (each rank
    holds whole heads of both)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % ranks or kv_heads % ranks:
        raise ValueError(
            f"{ranks} ranks do not divide the model's {heads} attention heads and "
            f"{kv_heads} KV heads"
        )


def load_sharded(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """This rank's shard of the model at `path`; every rank of the default process group calls
    it (the group must be initialised: gloo on CPU, NCCL on GPUs)."""
    return AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        distributed_config=DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size()),
    ).eval()


class _Prefills(dict[int, DynamicCache]):
    """A follower's prefill caches by the leader's key; a new key starts an empty one."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config

    def __missing__(self, key: int) -> DynamicCache:
        self[key] = cache = DynamicCache(config=self.config)
        return cache


class Link:
    """Rank 0's broadcasts to the other ranks: a header (the call, its scalars, the shapes and
    dtypes of its tensors) as an object, then each tensor on the model's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def send(self, op: str, args: Sequence[Any] = ()) -> None:
        tensors: list[torch.Tensor] = []
        encoded = []
        for a in args:
            if isinstance(a, torch.Tensor):
                encoded.append((_TENSOR, len(tensors)))
                tensors.append(a)
            elif isinstance(a, DynamicCache | PrefillKV):
                encoded.append((_PREFILL, id(a)))
            else:
                encoded.append(a)
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        dist.broadcast_object_list([(op, encoded, specs)], src=0)
        for t in tensors:  # gloo does not broadcast bool
            wire = t.to(self.device, torch.uint8 if t.dtype == torch.bool else t.dtype)
            dist.broadcast(wire.contiguous(), src=0)

    def recv(self, prefills: dict[int, DynamicCache]) -> tuple[str, list[Any]]:
        """The next call and its arguments; a prefill's cache is this rank's one under the
        leader's key (`prefills`, where a new key's first chunk starts one)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, encoded, specs = box[0]
        tensors = []
        for shape, dtype in specs:
            wire = torch.empty(
                shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device
            )
            dist.broadcast(wire, src=0)
            tensors.append(wire.to(dtype))
        args = []
        for a in encoded:
            if isinstance(a, tuple) and a and a[0] == _TENSOR:
                args.append(tensors[a[1]])
            elif isinstance(a, tuple) and a and a[0] == _PREFILL:
                args.append(prefills[a[1]])
            else:
                args.append(a)
        return op, args


class LeaderModel:
    """The sharded model as the leader's `BatchDecoder` sees it: each forward is broadcast
    before it runs, so every rank runs it on the same inputs. Everything else is the model's."""

    def __init__(self, model: PreTrainedModel, link: Link) -> None:
        self.model, self.link = model, link

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: StaticKV,
        logits_to_keep: int = 0,
    ):
        if not isinstance(past_key_values, PrefillKV):
            kv = past_key_values
            self.link.send(
                "verify", (input_ids, attention_mask, position_ids, kv.full_view, kv.write_slots)
            )
        else:
            self.link.send(
                "prefill",
                (input_ids, attention_mask, position_ids, logits_to_keep, past_key_values),
            )
        return self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            logits_to_keep=logits_to_keep,
        )


# the cache rewrites a follower mirrors (the ones `BatchDecoder` calls)
_REWRITES = (
    "reserve",
    "keep_region",
    "keep_roots",
    "gather_slots",
    "select_rows",
    "clear",
    "append_rows",
    "discard_prefill",
    "resize",
)


class LeaderKV(StaticKV):
    """The leader's cache: each rewrite the decoder asks for is broadcast first (a rewrite's
    own inner calls, such as `append_rows` reserving room, are not: followers make them too)."""

    def __init__(self, model: LeaderModel, link: Link) -> None:
        self.link, self._depth = link, 0
        super().__init__(model, shards=dist.get_world_size())

    def _mirror(self, name: str, args: tuple) -> Any:
        if self._depth == 0:
            self.link.send(name, args)
        self._depth += 1
        try:
            return getattr(super(), name)(*args)
        finally:
            self._depth -= 1

    def reserve(self, *args):
        return self._mirror("reserve", args)

    def keep_region(self, *args):
        return self._mirror("keep_region", args)

    def keep_roots(self, *args):
        return self._mirror("keep_roots", args)

    def gather_slots(self, *args):
        return self._mirror("gather_slots", args)

    def select_rows(self, *args):
        return self._mirror("select_rows", args)

    def clear(self, *args):
        return self._mirror("clear", args)

    def append_rows(self, *args):
        return self._mirror("append_rows", args)

    def discard_prefill(self, *args):
        return self._mirror("discard_prefill", args)

    def resize(self, *args):
        return self._mirror("resize", args)


def leader_decoder(
    model: PreTrainedModel,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str] | None = None,
    compact_slack: int = 64,
    full_view: bool = False,
) -> BatchDecoder:
    """Rank 0's decoder over its shard: an ordinary `BatchDecoder` whose forwards and cache
    rewrites the followers mirror. No CUDA graphs yet (a graph replay would skip the
    broadcast)."""
    link = Link(model.device)
    leader = LeaderModel(model, link)
    return BatchDecoder(
        leader,  # type: ignore[arg-type]  # duck-typed: forwards everything but the call
        eos_ids,
        decode,  # each follower prefills beside the leader
        cache=LeaderKV(leader, link),
        options=DecoderOptions(
            compact_slack=compact_slack, cuda_graphs=False, full_view=full_view, prompt_cache=False
        ),
    )


def stop(decoder: BatchDecoder) -> None:
    """End the followers' loop (the leader is done with the replica)."""
    decoder.model.link.send(_STOP)


@torch.inference_mode()
def follow(model: PreTrainedModel) -> None:
    """A follower's loop: apply every call the leader broadcasts to this rank's shard, until
    `stop`."""
    if model.device.type == "cuda":  # as the leader's decoder does (`BatchDecoder`)
        use_grouped_attention(model)
    link, cache = Link(model.device), StaticKV(model, shards=dist.get_world_size())
    prefills = _Prefills(model.config)  # the prefills in progress, by the leader's key
    while True:
        op, args = link.recv(prefills)
        if op == _STOP:
            return
        if op == "prefill":  # a chunk, into its prefill's cache
            ids, mask, pos, keep, prefill = args
            model(
                ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=prefill,
                logits_to_keep=keep,
            )
        elif op == "verify":
            ids, mask, pos, cache.full_view, cache.write_slots = args
            try:
                model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            finally:
                cache.write_slots = None
        elif op in _REWRITES:
            getattr(cache, op)(*args)
            if op in ("append_rows", "discard_prefill"):  # that prefill's cache is done with
                done = [k for k, v in prefills.items() if v is args[0]]
                for k in done:
                    del prefills[k]
        else:
            raise ValueError(f"unknown tensor-parallel op {op!r}")
