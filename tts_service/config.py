"""Pydantic schemas for every config, validated once at the boundary (CLI, YAML, HTTP).

Inner code receives the slice it uses (`SamplingConfig`, one member of `DrafterConfig`), never
the whole tree, and no module below the edge reads environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from store.config import StoreConfig
from tts_service.drafters.methods import METHOD_NAMES

TREES_DIR = Path(__file__).resolve().parents[1] / "configs" / "trees"


def resolve_tree_path(name_or_path: str) -> Path:
    """`configs/trees/<name>.json` for a bare name, else the path itself.

    Raises:
        ValueError: no such file (the message lists the known names).
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = TREES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in TREES_DIR.glob("*.json"))
        raise ValueError(f"tree {name_or_path!r} not found (known: {', '.join(known)})")
    return path


def _check_tree(name_or_path: str) -> str:
    resolve_tree_path(name_or_path)
    return name_or_path


TreeName = Annotated[str, AfterValidator(_check_tree)]


def _check_text(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty or blank")
    return text


def _check_file(path: Path | None) -> Path | None:
    if path is not None and not path.is_file():
        raise ValueError(f"no such file: {path}")
    return path


Text = Annotated[str, AfterValidator(_check_text)]
ExistingFile = Annotated[Path, AfterValidator(_check_file)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Strict):
    """How the target model's next token is chosen: exactly what plain decoding samples from."""

    temperature: float = Field(0.6, ge=0.0, description="0 means greedy (argmax).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus filter, (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    max_new_tokens: int = Field(256, ge=1, description="Generation stops after this many tokens.")
    seed: int = Field(0, ge=0, description="Seeds the trajectory's sampling and drafting streams.")
    stop: tuple[str, ...] = Field((), description="Stop strings; the output ends with the first.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks only).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class ModelConfig(_Strict):
    """Which target model to load and where it runs."""

    name: str = Field("smollm2-135m", min_length=1, description="Alias, hub id or local path.")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto' (cuda if present, else cpu), 'cpu', 'cuda:0'.")
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    max_memory: dict[str, str] | None = Field(
        None,
        description="Shard over the visible GPUs (device_map='auto') within these per-device "
        "budgets, e.g. {'0': '70GiB', '1': '70GiB', 'cpu': '0GiB'}; set by the placement plan.",
    )
    tune_matmul: bool = Field(
        True,
        description="On a CPU, time both matrix products of every linear layer shape at load "
        "and use the faster per row count (engine/matmul.py).",
    )


Sizing = Annotated[
    Literal["fixed", "gt"],
    Field(
        description="fixed: num_nodes every step; gt: the GT rule prunes the tree each step to "
        "what the measured verify cost pays for (num_nodes is the cap)."
    ),
]


class PlainDrafterConfig(_Strict):
    """No drafting: every step verifies the root only (plain decoding through the engine)."""

    kind: Literal["plain"] = "plain"


class PldDrafterConfig(_Strict):
    """Prompt Lookup Decoding (Saxena 2023): copy the continuation of the latest n-gram match."""

    kind: Literal["pld"] = "pld"
    max_ngram: int = Field(3, ge=1, le=8, description="Longest suffix n-gram tried first.")
    min_ngram: int = Field(1, ge=1, le=8, description="Shortest suffix n-gram tried last.")
    num_draft_tokens: int = Field(6, ge=1, le=64, description="Chain length drafted per step.")


class RecyclingDrafterConfig(_Strict):
    """Token Recycling (Luo et al. 2024): top-k successor table refreshed from every forward."""

    kind: Literal["recycling"] = "recycling"
    k: int = Field(8, ge=1, le=10, description="Successors kept per token (table width).")
    tree: TreeName = Field(
        "recycling-80", description="Tree shape: a name in configs/trees or a path."
    )
    num_nodes: int = Field(
        16, ge=1, le=1024, description="Use the first N nodes (BFS) of the tree."
    )
    sizing: Sizing = "fixed"


class StandDrafterConfig(_Strict):
    """STAND (Song et al. 2025): stochastic trees drawn from a shared logit n-gram store."""

    kind: Literal["stand"] = "stand"
    tree: TreeName = Field("stand-80", description="A name in configs/trees or a JSON path.")
    num_nodes: int = Field(16, ge=1, le=1024, description="Use the tree's first N nodes.")
    stochastic: bool = Field(True, description="Gumbel-Top-K children; False: top-k (ablation).")
    harvest_rejected: bool = Field(
        False, description="Also store the target's distributions at rejected tree nodes."
    )
    noise_buffer: int = Field(4096, ge=16, description="Gumbel noise values drawn per refill.")
    sizing: Sizing = "fixed"


class StandSpineDrafterConfig(StandDrafterConfig):
    """STAND's branches off a spine copied from an exact match in the problem's trajectories."""

    kind: Literal["stand_spine"] = "stand_spine"  # type: ignore[assignment]
    min_match: int = Field(4, ge=2, le=8, description="Shortest suffix match that lays a spine.")
    max_spine: int = Field(8, ge=1, le=64, description="Longest spine copied.")
    spine_share: float = Field(0.5, gt=0, le=1, description="At most this share of the nodes.")
    consensus_k: int = Field(
        3, ge=1, le=10, description="The spine's first token must be in the store's top k."
    )

    @field_validator("sizing")
    @classmethod
    def _fixed_only(cls, v: str) -> str:
        if v != "fixed":
            raise ValueError("stand_spine trees are sized by num_nodes (use gtcp for GT sizing)")
        return v


class GooseDrafterConfig(_Strict):
    """Goose (anisotropic spine trees): a context-match spine with Token Recycling branches."""

    kind: Literal["goose"] = "goose"
    num_nodes: int = Field(59, ge=1, le=1024, description="Draft nodes (the paper's B = 60).")
    max_depth: int = Field(6, ge=1, le=64, description="Branch depth from the branching point.")
    k: int = Field(10, ge=1, le=10, description="Successors kept per token.")
    ngram_orders: tuple[int, ...] = Field((3, 4, 5), description="Context-match n-gram lengths.")
    max_spine: int = Field(20, ge=1, le=256, description="Longest spine continuation.")
    bypass_len: int = Field(8, ge=1, description="A match this long is drafted as a chain.")
    spine_branch_ratio: float = Field(0.5, ge=0, le=1, description="ρ: spine vs root branches.")
    min_score: float = Field(0.01, ge=0, le=1, description="Successors below this are pruned.")
    ema: float = Field(0.3, gt=0, le=1, description="Smoothing of the spine acceptance p̂_s.")
    initial_spine_rate: float = Field(0.3, ge=0, le=1)

    @field_validator("ngram_orders")
    @classmethod
    def _orders(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or min(v) < 1 or max(v) > 16:
            raise ValueError("n-gram lengths must be in 1..16")
        return v


class PtdDrafterConfig(_Strict):
    """PTD: the target drafts for itself from a progressive perturbation tree."""

    kind: Literal["ptd"] = "ptd"
    max_depth: int = Field(6, ge=2, le=32, description="The perturbation tree steps past this.")
    max_children: int = Field(4, ge=1, le=16, description="Children per node (width limit).")
    perturbation_nodes: int = Field(16, ge=1, le=512, description="Perturbation tree size cap.")
    candidate_nodes: int = Field(16, ge=1, le=512, description="Candidate nodes verified.")


class GtcpDrafterConfig(_Strict):
    """GTCP: dynamic trees over STAND's store, as large as the measured verify cost pays for."""

    kind: Literal["gtcp"] = "gtcp"
    max_nodes: int = Field(128, ge=1, le=1024, description="Hard cap on draft nodes.")
    stochastic: bool = Field(True, description="Gumbel-ordered children; False: top-k.")
    harvest_rejected: bool = False
    noise_buffer: int = Field(4096, ge=16)


DrafterConfig = Annotated[
    PlainDrafterConfig
    | PldDrafterConfig
    | RecyclingDrafterConfig
    | StandDrafterConfig
    | StandSpineDrafterConfig
    | GooseDrafterConfig
    | PtdDrafterConfig
    | GtcpDrafterConfig,
    Field(discriminator="kind"),
]
DRAFTER_CONFIGS: dict[str, type[BaseModel]] = {
    c.model_fields["kind"].default: c for c in get_args(get_args(DrafterConfig)[0])
}
"""Drafter kind -> its config model (which flags and preset fields a kind takes)."""


class GenerateRequest(_Strict):
    """One `tts generate` call: validated before anything is loaded."""

    prompt: Text
    model: ModelConfig = ModelConfig()
    drafter: DrafterConfig = PldDrafterConfig()
    sampling: SamplingConfig = SamplingConfig()
    chat: bool = False


MaxRows = Annotated[int, Field(ge=1, le=256)]


def default_max_rows(device: str) -> int:
    """Rows decoded together when the user does not say: 16 on a CPU (a 16-row step costs
    ~2.3x a 1-row step here, so the batch pays; more rows stop paying), 64 on a GPU."""
    return 64 if device.startswith("cuda") else 16


class SolveRequest(_Strict):
    """One `tts solve` call: best-of-N trajectories for one question or a problems file."""

    question: Text | None = None
    problems: ExistingFile | None = Field(None, description="JSONL of problems (jobs' format).")
    task: Literal["math", "choice", "code"] = Field("math", description="How answers are voted.")
    n: int = Field(16, ge=1, le=64, description="Trajectories per problem.")
    model: ModelConfig = ModelConfig()
    drafter: DrafterConfig = StandDrafterConfig()
    sampling: SamplingConfig = SamplingConfig()
    store: StoreConfig = StoreConfig()
    chat: bool = True
    max_rows: MaxRows | None = Field(
        None, description="Rows decoded together (1: sequential); None: from the device."
    )

    @model_validator(mode="after")
    def _one_source(self) -> SolveRequest:
        if (self.question is None) == (self.problems is None):
            raise ValueError("give exactly one of question or problems")
        return self


class CalibrateTreeRequest(_Strict):
    """`tts calibrate-tree`: grow a big STAND tree on calibration prompts, keep the best nodes."""

    prompts: ExistingFile | None = Field(None, description="JSONL, a 'prompt' field per line.")
    trajectories: ExistingFile | None = Field(None, description="Replay this log instead.")
    n: int = Field(4, ge=1, le=64, description="Trajectories per prompt (they share a store).")
    init_tree: TreeName = "stand-625"
    nodes: int = Field(80, ge=1, le=1024, description="Nodes kept in the calibrated tree.")
    out: Path
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig(max_new_tokens=128)
    chat: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> CalibrateTreeRequest:
        if (self.prompts is None) == (self.trajectories is None):
            raise ValueError("give exactly one of prompts (live) or trajectories (replay)")
        return self


class ReplayRequest(_Strict):
    """`tts replay`: a drafter's acceptance length on logged trajectories, without the model."""

    method: Literal["pld", "recycle", "stand"]
    trajectories: ExistingFile
    tree: TreeName | None = None
    nodes: int | None = Field(None, ge=1, le=1024, description="Tree size (PLD: chain length).")
    vocab_size: int | None = Field(None, ge=1)
    strict: bool = False


class Problem(_Strict):
    """One line of a problems file."""

    id: str = Field(min_length=1)
    question: str = Field(min_length=1)
    task: Literal["math", "choice", "code"] = "math"
    answer: str | None = None


class JobConfig(_Strict):
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
    cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs per actor (its threads).")
    gpu_memory_gb: float = Field(80.0, gt=0, description="Memory of one GPU, for the plan.")
    chat: bool = True
    early_stop: bool = Field(
        False, description="Stop launching a problem's trajectories once its vote is decided."
    )
    max_retries: int = Field(3, ge=0, description="Resubmissions of a failed actor call.")
    log_trajectories: bool = Field(
        False, description="Also write trajectory-log.jsonl (with top-k) for `tts replay`."
    )


class ServeConfig(_Strict):
    """The HTTP service: one model per replica, OpenAI-compatible routes plus /v1/solve."""

    model: ModelConfig = ModelConfig()
    served_model_name: str | None = Field(None, description="Name in /v1/models (default: model).")
    default_method: str = Field("stand", description="A method name (drafters/methods.py).")
    drafters: dict[str, dict] = Field(
        default_factory=dict, description="Per-method drafter fields, as in configs/default.yaml."
    )
    store: StoreConfig = StoreConfig()
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"
    num_replicas: int = Field(1, ge=1)
    autoscaling: dict | None = Field(None, description="Serve autoscaling_config (min/max...).")
    cpus_per_replica: float = Field(1.0, gt=0)
    max_n: int = Field(64, ge=1, le=64)
    max_tokens_cap: int = Field(1024, ge=1, description="Largest max_tokens a request may ask.")
    default_max_tokens: int = Field(256, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get 413.")
    max_rows: MaxRows | None = Field(None, description="Rows a replica decodes together.")

    @field_validator("default_method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        if v not in METHOD_NAMES:
            raise ValueError(f"unknown method {v!r} (choose {', '.join(METHOD_NAMES)})")
        return v

    @field_validator("store")
    @classmethod
    def _no_private_redis(cls, v: StoreConfig) -> StoreConfig:
        if v.url == "local-redis":
            raise ValueError("local-redis is for one command; give the service a redis:// URL")
        return v


def load_yaml(path: str | Path) -> dict:
    """Read a preset from `configs/`; the caller validates it into a model."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


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
