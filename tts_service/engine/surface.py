"""The step cost surface T(rows, width, context), learned from the runner's own steps.

Nobody waits for a calibration. A new surface starts from an analytic roofline of the model
(weight and KV bytes read, FLOPs computed) scaled to this device by four timed forwards (a
fraction of a second), or from the surface an earlier process kept on disk for the same model
and device. Every step the runner then takes is a timed forward of a known shape, so the
surface refines itself where the runner works: a level (how fast the device is now, which
load moves for every shape at once) and, per shape bucket (rows and width rounded up to powers
of two, context to its bucket), a decayed mean offset of log(observed / roofline); a bucket
with no evidence of its own takes the mean offset (`CostSurface`).

Every estimate comes with an uncertainty: the roofline's (a factor of about 1.5) where nothing
was timed, shrinking with each recent step of that shape by the steps' own scatter (measured
as the surface goes), and growing again, without bound, with the steps since that shape was
last timed. The allocator decides cautiously (a tree's untimed cost counts high, plain's
low) and explores the bold reverse within a budget of steps
(`engine.allocate.SpeculationPlanner`), so speculation is tried where it might pay and costs
at most that budget where it does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from tts_service.engine.cost import CALIBRATION_SIZES, BatchCost, VerifyCost, context_bucket

if TYPE_CHECKING:
    from collections.abc import Callable


SIGMA_PRIOR = 0.4  # log-uncertainty of the roofline where nothing was timed (about ×1.5)
SIGMA_NOISE = 0.15  # the scatter of one step's log time around its bucket's, until measured
LEVEL_RATE = 0.1  # how fast the device's overall speed follows surprises on known shapes
DRIFT_VAR = 5e-4  # per step since a bucket was last timed: a device can change (σ 0.5 at 500)
DECAY = 0.95  # per step: a bucket's mean follows its last ~20 steps
MAX_SAVED_WEIGHT = 8.0  # a loaded surface is trusted like 8 steps, so a new process adapts
CPU_WIDE_TOKENS = 32  # the second timed forward: tokens in one row
CUDA_WIDE_TOKENS = 256


def power_bucket(x: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= x."""
    return 1 << max(0, int(x) - 1).bit_length()


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs from a model: bytes read and FLOPs per token."""

    weight_bytes: float
    kv_bytes_per_token: float  # keys and values of every layer, per row and cached token
    flops_per_token: float  # the matrix products: 2 × parameters
    attention_flops_per_key: float  # per token and attended key: QKᵀ and AV, every layer

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelShape:
        cfg = model.config.get_text_config()
        params = sum(p.numel() for p in model.parameters())
        elem = next(model.parameters()).element_size()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = cfg.num_hidden_layers
        return cls(
            weight_bytes=float(params * elem),
            kv_bytes_per_token=float(2 * layers * kv_heads * head_dim * elem),
            flops_per_token=float(2 * params),
            attention_flops_per_key=float(4 * layers * heads * head_dim),
        )


@dataclass(frozen=True)
class Roofline:
    """T = max(M, C) + overlap · min(M, C): M the bytes read over `bandwidth`, C the FLOPs
    over `flops`. `overlap` 1 (a CPU: reading and computing add up) or 0 (a GPU: they
    overlap, whichever is the bottleneck sets the time)."""

    shape: ModelShape
    bandwidth: float  # bytes / s
    flops: float  # FLOP / s
    overlap: float

    def parts(self, rows: int, width: int, context: int) -> tuple[float, float]:
        return self._memory(rows, context), self._compute(rows, width, context)

    def _memory(self, rows: int, context: int) -> float:
        s = self.shape
        return (s.weight_bytes + rows * context * s.kv_bytes_per_token) / self.bandwidth

    def _compute(self, rows: int, width: int, context: int) -> float:
        s = self.shape
        per_token = s.flops_per_token + (context + width) * s.attention_flops_per_key
        return rows * width * per_token / self.flops

    def time(self, rows: int, width: int, context: int) -> float:
        m, c = self.parts(rows, width, context)
        return max(m, c) + self.overlap * min(m, c)

    def times(self, rows: int, widths: int, context: int) -> list[float]:
        """`time` at widths 1..`widths` (the memory term read once)."""
        m, out = self._memory(rows, context), []
        for w in range(1, widths + 1):
            c = self._compute(rows, w, context)
            out.append(max(m, c) + self.overlap * min(m, c))
        return out

    @classmethod
    def fit(
        cls,
        shape: ModelShape,
        overlap: float,
        context: int,
        one_s: float,
        wide_s: float,
        wide: int,
    ) -> Roofline:
        """The bandwidth and FLOP rate that explain two timed one-row forwards over a
        `context`-token cache: one token (`one_s`) and `wide` tokens (`wide_s`).

        Additive (CPU): one token costs M + c, `wide` cost M + wide·c. Overlapped (GPU): one
        token is memory-bound (M), `wide` tokens at most compute-bound (C <= wide_s), an
        upper bound on the compute cost that the runner's own steps then correct."""
        one_s, wide_s = max(one_s, 1e-6), max(wide_s, one_s)
        flat = cls(shape, 1.0, 1.0, overlap)
        mem_work, comp_one = flat.parts(1, 1, context)
        _, comp_wide = flat.parts(1, wide, context)
        if overlap >= 1.0:
            per_unit = max((wide_s - one_s) / (comp_wide - comp_one), 0.02 * one_s / comp_one)
            memory_s = max(one_s - per_unit * comp_one, 0.1 * one_s)
        else:
            per_unit = wide_s / comp_wide
            memory_s = one_s
        return cls(shape, mem_work / memory_s, 1.0 / per_unit, overlap)

    def to_dict(self) -> dict:
        return {"bandwidth": self.bandwidth, "flops": self.flops, "overlap": self.overlap}


@dataclass
class _Evidence:
    """A decayed mean of log(observed / roofline): weight and weighted sum, as of `step`."""

    weight: float = 0.0
    total: float = 0.0
    step: int = 0

    def aged(self, now: int, decay: float) -> tuple[float, float]:
        f = decay ** max(0, now - self.step)
        return self.weight * f, self.total * f

    def add(self, log_ratio: float, now: int, decay: float) -> None:
        self.weight, self.total = self.aged(now, decay)
        self.weight += 1.0
        self.total += log_ratio
        self.step = now


Bucket = tuple[int, int, int]  # (rows, width, context) buckets


@dataclass
class CostSurface:
    """T(rows, width, context) of one model on one device (see the module docstring):

        log T = log roofline(shape) + level + offset(bucket of the shape)

    `level` is how fast the device is now against the roofline (it moves with load, clocks,
    a neighbour's job), learned from every step's surprise; a bucket's `offset` is how its
    shape departs from the roofline's, a decayed mean over its own steps. A shape nobody timed
    has the mean offset of the timed ones. `source` says where the surface started: `prior`
    (timed forwards now), `disk` (an earlier process's) or `measured` (the full grid at
    load, `ModelConfig.cost_model: measured`)."""

    roofline: Roofline
    source: str = "prior"
    decay: float = DECAY
    steps: int = 0
    level: float = 0.0
    buckets: dict[Bucket, _Evidence] = field(default_factory=dict)
    overall: _Evidence = field(default_factory=_Evidence)
    noise_var: float = SIGMA_NOISE**2  # a decayed mean of squared prediction errors
    surprises: int = 0  # steps of a new shape, or far off their estimate: re-read the surface
    path: Path | None = None  # where `save` keeps it
    _saved_at: float = field(default=0.0, repr=False)

    @staticmethod
    def bucket(rows: int, width: int, context: int) -> Bucket:
        return power_bucket(rows), power_bucket(width), context_bucket(context)

    def record(self, rows: int, width: int, context: int, seconds: float) -> None:
        """One step of this shape took `seconds` (its forward, verification and KV work)."""
        if seconds <= 0:
            return
        key = self.bucket(rows, width, context)
        r = math.log(seconds / self.roofline.time(rows, width, context))
        ev = self.buckets.get(key)
        if ev is not None and ev.weight > 0:  # a known shape: its surprise moves the level
            error = r - self.level - ev.total / ev.weight
            self.surprises += error * error > 4 * self.noise_var
            self.noise_var += 0.05 * (error * error - self.noise_var)
            self.level += LEVEL_RATE * error
        else:
            self.surprises += 1
            if not self.buckets:  # the first step sets the level
                self.level = r
        self.steps += 1
        self.buckets.setdefault(key, _Evidence()).add(r - self.level, self.steps, self.decay)
        self.overall.add(r - self.level, self.steps, self.decay)

    def correction(self, rows: int, width: int, context: int) -> tuple[float, float]:
        """(mean, sigma) of log(T / roofline) for this shape: the level plus its bucket's
        offset (old evidence weighs less, but never pulls toward other shapes), else plus
        the mean offset."""
        ev = self.buckets.get(self.bucket(rows, width, context))
        if ev is None or ev.weight <= 0:
            offset = self.overall.total / self.overall.weight if self.overall.weight else 0.0
            return self.level + offset, SIGMA_PRIOR
        w, _ = ev.aged(self.steps, self.decay)
        age = self.steps - ev.step
        var = 1.0 / (1.0 / SIGMA_PRIOR**2 + w / self.noise_var) + DRIFT_VAR * age
        return self.level + ev.total / ev.weight, math.sqrt(var)

    def time(self, rows: int, width: int, context: int, z: float = 0.0) -> float:
        """Estimated seconds of a step; `z` standard deviations up (pessimistic, z > 0) or
        down (optimistic, z < 0)."""
        mean, sigma = self.correction(rows, width, context)
        return self.roofline.time(rows, width, context) * math.exp(mean + z * sigma)

    def seed(self, grid: BatchCost, weight: float = 1000.0) -> None:
        """Take a measured grid as `weight` steps of evidence per shape, never forgotten
        (`cost_model: measured`)."""
        self.source, self.decay = "measured", 1.0
        for i, rows in enumerate(grid.rows):
            for j, width in enumerate(grid.widths):
                t = self.roofline.time(rows, width, grid.context_len)
                r = math.log(grid.seconds[i][j] / t) - self.level
                ev = self.buckets.setdefault(
                    self.bucket(rows, width, grid.context_len), _Evidence()
                )
                ev.weight += weight
                ev.total += weight * r
                self.overall.weight += weight
                self.overall.total += weight * r

    def line(self, rows: int, widths: int, context: int) -> list[tuple[float, float, float]]:
        """(roofline seconds, mean, sigma) at widths 1..`widths`: what `time` reads per width
        (T = roofline · exp(mean + z·sigma)), with one `correction` per width bucket. The
        planner prices every k from one line (`engine.allocate.SpeculationPlanner`)."""
        corrections: dict[int, tuple[float, float]] = {}
        out = []
        for w, t in enumerate(self.roofline.times(rows, widths, context), start=1):
            b = power_bucket(w)
            if b not in corrections:
                corrections[b] = self.correction(rows, w, context)
            out.append((t, *corrections[b]))
        return out

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "roofline": self.roofline.to_dict(),
            "level": self.level,
            "buckets": [
                [*key, *saved]
                for key, ev in sorted(self.buckets.items())
                if (saved := self._saved(ev))[0] > 0  # evidence that has faded out is dropped
            ],
        }

    def _saved(self, ev: _Evidence) -> tuple[float, float]:
        w, t = ev.aged(self.steps, self.decay)
        scale = min(1.0, MAX_SAVED_WEIGHT / w) if w > 0 else 0.0
        return round(w * scale, 4), round(t * scale, 6)

    @classmethod
    def from_dict(cls, data: dict, shape: ModelShape, path: Path | None = None) -> CostSurface:
        rf = data["roofline"]
        surface = cls(Roofline(shape, rf["bandwidth"], rf["flops"], rf["overlap"]), "disk")
        surface.path, surface.level = path, float(data["level"])
        for rows, width, context, w, t in data["buckets"]:
            if w <= 0:
                continue
            surface.buckets[(int(rows), int(width), int(context))] = _Evidence(w, t, 0)
            surface.overall.weight += w
            surface.overall.total += t
        scale = min(1.0, MAX_SAVED_WEIGHT / surface.overall.weight) if surface.overall.weight else 0
        surface.overall.weight *= scale
        surface.overall.total *= scale
        return surface

    def save(self, every_s: float = 0.0) -> None:
        """Write the surface to `path` (atomically), at most once per `every_s` seconds."""
        now = time.monotonic()
        if self.path is None or (every_s and now - self._saved_at < every_s):
            return
        self._saved_at = now
        if not write_json(self.path, self.to_dict()):
            self.path = None  # a read-only cache costs the next process four forwards, no more


class SurfaceVerifyCost:
    """GT sizing's one-row curve (`engine.cost.VerifyCost` per context bucket), read off the
    surface at its pessimistic bound and rebuilt as the surface learns (every 32 steps)."""

    def __init__(self, surface: Callable[[], CostSurface], z: float = 1.0) -> None:
        self._surface = surface  # opened at the first step that sizes a tree
        self.z = z
        self._curves: dict[int, tuple[int, VerifyCost]] = {}

    @property
    def curves(self) -> dict[int, VerifyCost]:
        """The curves read so far, per context bucket (as `CostModel.curves`, for reports)."""
        return {bucket: curve for bucket, (_, curve) in self._curves.items()}

    def at(self, context_len: int) -> VerifyCost:
        surface = self._surface()
        bucket = context_bucket(context_len)
        age = surface.steps // 32
        cached = self._curves.get(bucket)
        if cached is None or cached[0] != age:
            seconds = [surface.time(1, n, bucket, self.z) for n in CALIBRATION_SIZES]
            cached = (age, VerifyCost.fit(CALIBRATION_SIZES, seconds, bucket))
            self._curves[bucket] = cached
        return cached[1]


# -- where a surface comes from -----------------------------------------------------------
def write_json(path: Path, data: object) -> bool:
    """Write `data` to `path` atomically (a reader never sees half a file); False where the
    cache cannot be written (read-only, full): what is kept there is only ever a head start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        return False
    return True


def hardware(device: torch.device) -> str:
    """The device as timings depend on it: the GPU's name, or the CPU's model and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()}-{_cpu_model()}-{torch.get_num_threads()}t"


def device_key(model: PreTrainedModel, name: str) -> str:
    """A file name per (model, device, dtype, threads): surfaces are not portable."""
    cfg = model.config.to_json_string()
    hw = hardware(model.device)
    digest = hashlib.sha1(f"{name}|{cfg}|{hw}|{model.dtype}".encode()).hexdigest()[:16]
    label = "".join(c if c.isalnum() else "-" for c in name)[-40:]
    return f"{label}-{model.device.type}-{digest}.json"


def matmul_cache_file(cache_dir: Path, model: PreTrainedModel) -> Path:
    """Where `engine.matmul` keeps its per-shape choices for this CPU, threads and dtype."""
    digest = hashlib.sha1(f"{hardware(model.device)}|{model.dtype}".encode()).hexdigest()[:16]
    return cache_dir / f"matmul-{digest}.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


@torch.inference_mode()
def time_prior(model: PreTrainedModel, context: int = 128, cuda_graphs: bool = True) -> Roofline:
    """The roofline scaled by four timed one-row forwards over a `context`-token cache: one
    token and many, each timed twice, the faster kept (the first run warms up kernels and, on a
    GPU, captures the graph). Timed as the steps will run: an eager 7B forward on a GPU is
    launch-bound at twice a graph's time, a prior that flattened every tree's cost."""
    from tts_service.engine.batch import BatchDecoder
    from tts_service.engine.options import DecoderOptions

    wide = CUDA_WIDE_TOKENS if model.device.type == "cuda" else CPU_WIDE_TOKENS
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(cuda_graphs=cuda_graphs))
    decoder.fill_random(1, context)
    one = min(decoder.time_forward(1, 1) for _ in range(2))
    many = min(decoder.time_forward(1, wide) for _ in range(2))
    overlap = 0.0 if model.device.type == "cuda" else 1.0
    return Roofline.fit(ModelShape.of(model), overlap, context, one, many, wide)


def open_surface(
    model: PreTrainedModel, name: str, cache_dir: Path | None, cuda_graphs: bool = True
) -> CostSurface:
    """This model's surface: the one kept in `cache_dir` for this device if there is one and
    it reads, else a new prior (four timed forwards, graph-captured where the steps will be).
    It is saved back there as it learns."""
    path = cache_dir / device_key(model, name) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return CostSurface.from_dict(data, ModelShape.of(model), path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: start over (and overwrite it)
    return CostSurface(time_prior(model, cuda_graphs=cuda_graphs), "prior", path=path)
