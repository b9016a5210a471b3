"""How a batch decoder runs: one frozen object, resolved against the device once.

The defaults follow the device: on CUDA the verify forward is captured per bucket, attention
spans the whole cache (the static shapes graphs need), tree steps read each KV head once, and
the acceptance is captured beside the forward; on a CPU none of these. A caller states only
what it wants otherwise (tests, benchmarks, tensor-parallel ranks)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tts_service.engine.prefill import max_chunk

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DecoderOptions:
    """`compact_slack`: holes a row's cache may hold past its entries before the cache is
    compacted. `cuda_graphs`: capture the verify forward per (rows, tokens) bucket (a CUDA
    device only). `full_view`: attention spans the whole preallocated cache (on by itself with
    graphs; tests turn it on to check the masks graphs use on a CPU). `prompt_cache`: keep
    recent prompts' prefilled KV. `defer_observation`: what the drafters defer of observing a
    step runs during the next forward (False: at once, the reference the tests compare with).
    `grouped_attention`: run an SDPA model's tree steps over each KV head once
    (`engine.attention`; None: on a CUDA device). `graph_acceptance`: capture the step's
    acceptance too (None: wherever the forward is captured; on a CPU, true runs the captured
    path eagerly, as the tests and the host benchmark check it). `prefill_chunk`: the most
    prompt tokens one prefill forward runs (`engine.prefill`; None: the device's,
    `prefill.max_chunk`)."""

    compact_slack: int = 64
    cuda_graphs: bool = True
    full_view: bool = False
    prompt_cache: bool = True
    defer_observation: bool = True
    grouped_attention: bool | None = None
    graph_acceptance: bool | None = None
    prefill_chunk: int | None = None

    def resolved(self, device: torch.device) -> DecoderOptions:
        """Every choice made for `device`: no None left, graphs only on CUDA."""
        cuda = device.type == "cuda"
        graphs = self.cuda_graphs and cuda
        return replace(
            self,
            cuda_graphs=graphs,
            full_view=self.full_view or graphs,
            grouped_attention=cuda if self.grouped_attention is None else self.grouped_attention,
            graph_acceptance=graphs if self.graph_acceptance is None else self.graph_acceptance,
            prefill_chunk=self.prefill_chunk or max_chunk(device),
        )


DEFAULTS = DecoderOptions()
"""Every choice left to the device."""
