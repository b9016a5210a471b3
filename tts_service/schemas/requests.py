"""The CLI's requests (`tts generate|solve|calibrate-tree|replay`): validated before anything
is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from store.config import StoreConfig
from tts_service.aggregate.confidence import Aggregate, vote_fields
from tts_service.config import (
    ExistingFile,
    MaxRows,
    ModelConfig,
    SamplingConfig,
    StrictConfig,
    Text,
    TreeName,
)
from tts_service.drafters.pld import PldDrafterConfig
from tts_service.drafters.registry import REPLAY_METHODS, DrafterConfig
from tts_service.drafters.stand_config import StandDrafterConfig

ReplayMethod = Literal[REPLAY_METHODS]  # type: ignore[valid-type]


class GenerateRequest(StrictConfig):
    """One `tts generate` call: validated before anything is loaded."""

    prompt: Text
    model: ModelConfig = ModelConfig()
    drafter: DrafterConfig = PldDrafterConfig()
    sampling: SamplingConfig = SamplingConfig()
    chat: bool = False
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks of one tensor-parallel replica: Ray actors, gloo on CPU, NCCL on "
        "GPUs (1: this process).",
    )


class SolveRequest(StrictConfig):
    """One `tts solve` call: best-of-N trajectories for one question or a problems file."""

    question: Text | None = None
    problems: ExistingFile | None = Field(None, description="JSONL of problems (jobs' format).")
    task: Literal["math", "choice", "code"] = Field(
        "math", description="How answers are voted: math, choice or code."
    )
    n: int = Field(16, ge=1, le=64, description="Trajectories per problem.")
    early_stop: bool = Field(
        True,
        description="Stop a problem's other trajectories once its vote is decided (the leader "
        "ahead by more than the trajectories still running: the answer all N would give); "
        "off: all N decode (for maj@k, pass@k).",
    )
    confidence: bool = Field(
        True,
        description="Each trajectory's confidence (DeepConf's mean, lowest and bottom-tenth "
        "group, and tail), from the target's top-k at every committed token (about a "
        "hundredth of the whole command).",
    )
    aggregate: Aggregate = Field(
        "majority",
        description="The vote: majority (exact), confidence (weighted by each trajectory's "
        "confidence) or filtered (the most confident nine tenths vote); the last two change "
        "answers, need confidence and decode all N.",
    )
    model: ModelConfig = ModelConfig()
    drafter: DrafterConfig = StandDrafterConfig()
    sampling: SamplingConfig = SamplingConfig()
    store: StoreConfig = StoreConfig()
    chat: bool = True
    max_rows: MaxRows | None = Field(
        None, description="Rows decoded together (1: sequential); unset: 16 on a CPU, 64 on a GPU."
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks sharding the model: this process and Ray actors, gloo on CPU, NCCL "
        "on GPUs (1: this process alone).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SolveRequest:
        if (self.question is None) == (self.problems is None):
            raise ValueError("give exactly one of question or problems")
        return self

    _vote_fields = model_validator(mode="before")(vote_fields)


class CalibrateTreeRequest(StrictConfig):
    """`tts calibrate-tree`: grow a big STAND tree on calibration prompts, keep the best nodes."""

    prompts: ExistingFile | None = Field(None, description="JSONL, a 'prompt' field per line.")
    trajectories: ExistingFile | None = Field(None, description="Replay this log instead.")
    n: int = Field(4, ge=1, le=64, description="Trajectories per prompt (they share a store).")
    init_tree: TreeName = Field("stand-625", description="The large tree grown on the prompts.")
    nodes: int = Field(80, ge=1, le=1024, description="Nodes kept in the calibrated tree.")
    out: Path = Field(description="Where the calibrated tree's JSON is written.")
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig(max_new_tokens=128)
    chat: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> CalibrateTreeRequest:
        if (self.prompts is None) == (self.trajectories is None):
            raise ValueError("give exactly one of prompts (live) or trajectories (replay)")
        return self


class ReplayRequest(StrictConfig):
    """`tts replay`: a drafter's acceptance length on logged trajectories, without the model."""

    method: ReplayMethod
    trajectories: ExistingFile
    tree: TreeName | None = None
    nodes: int | None = Field(
        None, ge=1, le=1024, description="Draft node cap (PLD: chain length, at most 64)."
    )
    vocab_size: int | None = Field(None, ge=1)
    strict: bool = False
