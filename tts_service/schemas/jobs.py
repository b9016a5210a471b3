"""Best-of-N jobs: the problems file and the job's config."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from store.config import StoreConfig
from tts_service.aggregate.confidence import Aggregate, vote_fields
from tts_service.config import MaxRows, ModelConfig, SamplingConfig, StrictConfig
from tts_service.drafters.registry import DrafterConfig
from tts_service.drafters.stand_config import StandDrafterConfig


class Problem(StrictConfig):
    """One line of a problems file."""

    id: str = Field(min_length=1)
    question: str = Field(min_length=1)
    task: Literal["math", "choice", "code"] = "math"
    answer: str | None = None


class JobConfig(StrictConfig):
    """A best-of-N job: what runs, on how many actors, and how trajectories are spread."""

    model: ModelConfig = ModelConfig()
    drafter: DrafterConfig = StandDrafterConfig()
    sampling: SamplingConfig = SamplingConfig(max_new_tokens=512)
    store: StoreConfig = StoreConfig()
    n: int = Field(16, ge=1, le=64, description="Trajectories per problem.")
    batch: int = Field(4, ge=1, le=64, description="Trajectories of one problem per actor call.")
    max_rows: MaxRows | None = Field(
        None, description="Rows an actor decodes together, refilled from any call in flight."
    )
    replicas: int | None = Field(
        None, ge=1, description="Generator actors; None: as many as the placement plan allows."
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks of each replica (Ray actors sharding every layer, `actors.tp`); 1: "
        "one actor per replica. On GPUs the plan raises it to what the model needs.",
    )
    sharding: Literal["tensor_parallel", "device_map"] = Field(
        "tensor_parallel",
        description="How a model too big for one GPU is split: tensor_parallel (every GPU "
        "works on every forward) or device_map (layers one GPU after another; fallback).",
    )
    cpus_per_replica: float = Field(
        1.0, gt=0, description="Ray CPUs per actor (its threads); per rank when tensor-parallel."
    )
    gpu_memory_gb: float = Field(80.0, gt=0, description="Memory of one GPU, for the plan.")
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a job waits for a busy cluster to place every replica (a status "
        "line every 10 s), then fails naming what is missing.",
    )
    chat: bool = True
    early_stop: bool = Field(
        False,
        description="Stop a problem once its vote is decided: its trajectories not launched "
        "are dropped, those in flight cancelled (the answer all N would give).",
    )
    confidence: bool = Field(
        True,
        description="Each trajectory record's confidence (DeepConf's, from the target's top-k "
        "at every committed token).",
    )
    aggregate: Aggregate = Field(
        "majority",
        description="The vote: majority (exact), confidence (weighted) or filtered (the most "
        "confident nine tenths vote); the last two change answers and need confidence, "
        "without early_stop.",
    )
    max_retries: int = Field(3, ge=0, description="Resubmissions of a failed actor call.")
    log_trajectories: bool = Field(
        False, description="Also write trajectory-log.jsonl (with top-k) for `tts replay`."
    )

    @model_validator(mode="after")
    def _tensor_parallel_sharding(self) -> JobConfig:
        if self.tensor_parallel > 1 and self.sharding == "device_map":
            raise ValueError("tensor_parallel: > 1 needs sharding: tensor_parallel")
        return self

    _vote_fields = model_validator(mode="before")(vote_fields)


def read_problems(path: Path) -> list[Problem]:
    """A problems file: one JSON `Problem` per line, ids unique (ValueError naming the line)."""
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    problems, seen = [], set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            problem = Problem.model_validate_json(line)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "line"
            raise ValueError(f"{path}:{lineno}: {where}: {first['msg']}") from e
        if problem.id in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {problem.id!r}")
        seen.add(problem.id)
        problems.append(problem)
    if not problems:
        raise ValueError(f"{path} has no problems")
    return problems
