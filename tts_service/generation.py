"""One loaded model as the runner uses it (`runner.RunnerModel`): its decoder, its drafters,
its cost surface, and text in and out.

What drafters share per loaded model (Token Recycling's successor table: the hot start) lives
here, so it carries over between every run on the same `Generator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from store.base import NgramStore
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.kernels import auto_kernels, kernels_of, preload
from tts_service.drafters.registry import DrafterConfig, RowDrafters
from tts_service.engine.allocate import SlotStats, StepCost, measure_batch_cost
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.cost import VerifyCostSource
from tts_service.engine.decode import GenerationOutput, GenerationResult
from tts_service.engine.kv import default_kv_budget, slot_bytes
from tts_service.engine.options import DecoderOptions
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.seam import Drafter
from tts_service.engine.surface import CostSurface, SurfaceVerifyCost, open_surface
from tts_service.models import LoadedModel, encode_prompt, load_model, resolve_device


class InputTooLongError(ValueError):
    """The prompt plus max_new_tokens does not fit the model's context."""


class Generator:
    """`cost_model`: `learned` (the step cost surface starts from a roofline prior or the one
    kept in `cost_cache`, and learns from every step) or `measured` (the full grid of batched
    forwards is timed at the first step, as before: seconds to minutes on a CPU). `cost` and
    `batch_cost` fix both costs instead (tests, replay, tensor-parallel ranks); `surface`
    shares another generator's over the same loaded model."""

    def __init__(
        self,
        loaded: LoadedModel,
        cost: VerifyCostSource | None = None,
        batch_cost: StepCost | None = None,
        max_model_len: int | None = None,
        cost_model: str = "learned",
        cost_cache: Path | None = None,
        surface: CostSurface | None = None,
        prefill_chunk: int | None = None,
        kv_cache_memory: float | None = None,
    ) -> None:
        self.loaded = loaded
        self.slot_bytes = slot_bytes(loaded.model)  # a row's token in the KV cache
        self.kv_budget = (
            int(kv_cache_memory * 2**30)
            if kv_cache_memory is not None
            else default_kv_budget(loaded.device)
        )
        self.prefill_chunk = prefill_chunk  # tokens a prefill forward runs; None: the device's
        self.max_model_len = max_model_len  # below the model's context, if set
        self.cost_model = cost_model
        self.cost_cache = cost_cache
        self._surface = surface  # another generator's on the same model and device, or opened
        # GT sizing's one-row verify cost: off the surface unless fixed
        self.cost = cost or SurfaceVerifyCost(self.surface)
        self.drafters = RowDrafters(loaded.model.config.vocab_size, self.cost)
        self.fixed_batch_cost = batch_cost  # one surface everywhere (tests, replay)
        self._slots: dict[str, SlotStats] = {}  # per drafter config: α̂ by tree slot

    @classmethod
    def load(
        cls, cfg: ModelConfig, cache_dir: Path | None = None, drafter: DrafterConfig | None = None
    ) -> Generator:
        """The configured model, loaded. On a CUDA device the kernels of a compiled drafter load
        meanwhile (`drafters.kernels`): `drafter`'s, or with none named `auto`'s. On a CPU they
        load at the first compiled draft: a preload there, beside the model's load, made
        `tts solve --method stand` 1.2 s slower, where loading at the first draft cost 0.7
        (docs/benchmarks.md, "Start-up")."""
        if resolve_device(cfg.device).type == "cuda":
            module = kernels_of(drafter) if drafter is not None else auto_kernels()
            if module is not None:
                preload(module)
        return cls(
            load_model(cfg, cache_dir),
            max_model_len=cfg.max_model_len,
            cost_model=cfg.cost_model,
            cost_cache=cfg.cost_cache_dir,
            prefill_chunk=cfg.prefill_chunk,
            kv_cache_memory=cfg.kv_cache_memory,
        )

    def surface(self, max_rows: int = 1) -> CostSurface:
        """This model's step cost surface on this device, opened at the first need: from
        disk, or a roofline prior from four timed forwards (`engine.surface`); with
        `cost_model: measured`, seeded by timing every shape up to `max_rows` rows first."""
        if self._surface is None:
            model = self.loaded.model
            surface = open_surface(
                model, self.loaded.name, self.cost_cache, self.loaded.cuda_graphs
            )
            if self.cost_model == "measured":
                max_tokens = 4096 if model.device.type == "cuda" else 128
                grid = measure_batch_cost(
                    model, 256, max_rows, max_tokens, cuda_graphs=self.loaded.cuda_graphs
                )
                surface.seed(grid)
            self._surface = surface
        return self._surface

    def new_decoder(self) -> BatchDecoder:
        """A batch decoder over this model (the runner's, unless it is given one)."""
        loaded = self.loaded
        return BatchDecoder(
            loaded.model,
            loaded.eos_token_ids,
            self.decode,
            options=DecoderOptions(
                cuda_graphs=loaded.cuda_graphs,
                graph_acceptance=loaded.graph_acceptance,
                prefill_chunk=self.prefill_chunk,
            ),
        )

    def encode(self, prompt: str, chat: bool) -> list[int]:
        return encode_prompt(self.loaded.tokenizer, prompt, chat)

    def decode(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=True)

    def slot_stats(self, cfg: DrafterConfig) -> SlotStats:
        """How often each tree slot of this method's trees is accepted (the runner's α̂),
        learned across every run on this generator."""
        return self._slots.setdefault(cfg.model_dump_json(), SlotStats())

    def row_drafter(self, cfg: DrafterConfig, store: NgramStore, params: SamplingParams) -> Drafter:
        """A drafter for one trajectory or batch row: each has its own per-sequence state (PLD's
        index, the last tree); successor tables are shared by the generator, the spine index
        and GT's on-path statistics by the problem (one per store)."""
        return self.drafters.build(cfg, store, params)

    @property
    def context_limit(self) -> int | None:
        """The most tokens (prompt + new) a sequence may have: `max_model_len`, else the
        model's context; None if neither is known."""
        limit = getattr(self.loaded.model.config, "max_position_embeddings", None)
        if self.max_model_len is not None:
            limit = min(limit or self.max_model_len, self.max_model_len)
        return limit

    def check_fits(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """Raise ValueError unless the request can join a batch: its ids in the vocabulary
        (one bad id in a shared forward would fail every row beside it) and its length within
        the context (`InputTooLongError`)."""
        vocab = self.loaded.model.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is not in the vocabulary (0 to {vocab - 1})")
        limit, tokens = self.context_limit, len(prompt_ids) + sampling.max_new_tokens
        if limit and tokens > limit:
            raise InputTooLongError(
                f"{len(prompt_ids)} prompt tokens + {sampling.max_new_tokens} new tokens "
                f"exceed the context of {limit} (max_model_len, else the model's)"
            )
        if not self.kv_room([tokens]):
            raise InputTooLongError(
                f"{len(prompt_ids)} prompt tokens + {sampling.max_new_tokens} new tokens need "
                f"{tokens * self.slot_bytes / 2**30:.2f} GiB of KV cache; it may hold "
                f"{self.kv_budget / 2**30:.2f} GiB (model.kv_cache_memory)"
            )

    def kv_room(self, lengths: Sequence[int]) -> bool:
        """Whether rows of these lengths fit the KV cache together: the cache is dense, every
        row as long as the longest."""
        return len(lengths) * max(lengths, default=0) * self.slot_bytes <= self.kv_budget

    def output(self, res: GenerationResult) -> GenerationOutput:
        text = self.decode(list(res.token_ids))
        if res.stop_text is not None and res.stop_text in text:
            text = text[: text.find(res.stop_text)]
        return GenerationOutput(text, res.token_ids, res.finish_reason, res.stats)
