"""A tensor-parallel replica on Ray: G rank actors in one STRICT_PACK placement group (a bundle
per rank, so all ranks share a node), joined in a `torch.distributed` group (NCCL on GPUs,
gloo on CPU). Rank 0 decodes (`engine.tp.leader_decoder`); the others run `engine.tp.follow`
until the replica closes.

A replica either generates one prompt at a time (`generate`: `tts generate`) or, given a job,
serves the trajectory pool as a generator actor does (`leader.run`, a `GeneratorActor` on rank
0). A rank that dies breaks the whole group, so the replica is restarted as a whole
(`restart`: every actor killed, a new group); the pool resubmits what it had in flight.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from actors.placement import PlacementError
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.registry import DrafterConfig
from tts_service.schemas import JobConfig

if TYPE_CHECKING:
    from actors.host import RunnerHost
    from tts_service.engine.batch import BatchDecoder
    from tts_service.generation import Generator
    from tts_service.models import LoadedModel


def _address() -> str:
    """host:port free on this node, for a group's rendezvous."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def _join(cfg: ModelConfig, address: str, rank: int, world: int) -> LoadedModel:
    """Join the group at `address` (NCCL on GPUs, gloo on CPU) and load this rank's shard."""
    import torch.distributed as dist

    from tts_service.models import load_model_shard, resolve_device

    backend = "nccl" if resolve_device(cfg.device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world)
    return load_model_shard(cfg)


def _gpus_per_rank(cfg: ModelConfig) -> int:
    """A GPU per rank on CUDA, none on CPU."""
    from tts_service.models import resolve_device

    return 1 if resolve_device(cfg.device).type == "cuda" else 0


def _lead(cfg: ModelConfig, loaded: LoadedModel) -> tuple[Generator, BatchDecoder]:
    """Rank 0's generator and the decoder whose forwards and cache rewrites the others mirror.

    A verify-cost measurement would time forwards the other ranks do not mirror, so GT-sized
    methods price tree tokens by the fixed GPU-like curve (`GPU_LIKE_COST`, as replay does):
    on a tensor-parallel GPU replica tree tokens are nearly free, and the node cap binds."""
    from tts_service.engine.cost import GPU_LIKE_COST, CostModel
    from tts_service.engine.tp import leader_decoder
    from tts_service.generation import Generator

    gen = Generator(loaded, CostModel.fixed(GPU_LIKE_COST), max_model_len=cfg.max_model_len)
    return gen, leader_decoder(loaded.model, loaded.eos_token_ids, gen.decode)


class TensorParallelRank:
    """One rank of a replica (a plain class: `TensorParallelReplica` wraps it with Ray)."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.host: RunnerHost | None = None  # rank 0's, at the first `generate`

    def address(self) -> str:
        """host:port for the group's rendezvous, on this rank's node (rank 0's)."""
        return _address()

    def setup(
        self, address: str, job: JobConfig | None = None, store_url: str | None = None
    ) -> None:
        """Join the group and load this rank's shard (every rank at once: both are collective).
        With `job`, rank 0 also opens a `GeneratorActor` over its decoder for `run`."""
        self.loaded = _join(self.cfg, address, self.rank, self.world)
        if self.rank == 0:
            self.generator, self.decoder = _lead(self.cfg, self.loaded)
            if job is not None:
                from actors.generator import GeneratorActor

                self.worker = GeneratorActor(job, store_url, self.generator, self.decoder)

    def follow(self) -> None:
        """A follower's whole life: mirror rank 0 until it closes the replica."""
        from tts_service.engine.tp import follow

        follow(self.loaded.model)

    def generate(
        self, prompt: str, drafter: DrafterConfig, sampling: SamplingConfig, chat: bool
    ) -> dict:
        """Rank 0: one generation (`tts generate`'s JSON), through a runner over the decoder the
        other ranks mirror; one host for the rank's life, so its scratch store carries over
        between generations as a single process's does."""
        if self.host is None:
            from actors.host import RunnerHost

            self.host = RunnerHost(self.generator, max_rows=1, tp_decoder=self.decoder)
        ids = self.generator.encode(prompt, chat)
        return self.host.generate(ids, drafter, sampling).to_dict()

    def run(
        self,
        job_id: str,
        problem_id: str,
        question: str,
        indices: list[int],
        attempt: int = 0,
        cfg: JobConfig | None = None,
    ) -> list[dict]:
        """Rank 0 of a job's replica: `GeneratorActor.run` (the pool's call)."""
        return self.worker.run(job_id, problem_id, question, indices, attempt, cfg)

    def close_stores(self) -> None:
        """Rank 0 of a job's replica: `GeneratorActor.close`."""
        self.worker.close()

    def close(self) -> None:
        """Rank 0: end the followers' loops."""
        from tts_service.engine.tp import stop

        stop(self.decoder)


class TensorParallelReplica:
    """G rank actors in one STRICT_PACK placement group; `generate` runs on rank 0, and so does
    a job's `leader.run`. `following` are the followers' loops: one that ends before `close`
    means a rank died (the pool watches them). `gpus_per_rank`: default 1 on CUDA, else 0 (a
    plan may declare GPUs that a CPU run only reserves)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ranks: int,
        cpus_per_rank: float = 1.0,
        timeout_s: float = 60,
        job: JobConfig | None = None,
        store_url: str | None = None,
        max_concurrency: int = 1,
        gpus_per_rank: int | None = None,
    ) -> None:
        self.gpus_per_rank = _gpus_per_rank(cfg) if gpus_per_rank is None else gpus_per_rank
        self.cfg, self.world, self.job, self.store_url = cfg, ranks, job, store_url
        self.cpus_per_rank, self.timeout_s = cpus_per_rank, timeout_s
        self.max_concurrency = max_concurrency
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = self.gpus_per_rank
        bundle = {"CPU": self.cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([dict(bundle)] * self.world, strategy="STRICT_PACK")
        self.ranks = []
        if not self.group.wait(self.timeout_s):
            self.kill()
            raise PlacementError(
                f"{self.world} ranks of {bundle} on one node (STRICT_PACK) were not placed "
                f"within {self.timeout_s:g}s; the cluster has {ray.cluster_resources()}"
            )
        remote = ray.remote(TensorParallelRank)
        self.ranks = [
            remote.options(
                num_cpus=self.cpus_per_rank,
                num_gpus=gpus,
                max_concurrency=self.max_concurrency if r == 0 else 2,  # a probe beside `follow`
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=r
                ),
            ).remote(self.cfg, r, self.world)
            for r in range(self.world)
        ]
        try:
            address = ray.get(self.ranks[0].address.remote())
            ray.get([a.setup.remote(address, self.job, self.store_url) for a in self.ranks])
        except BaseException:
            self.kill()
            raise
        self.following = [a.follow.remote() for a in self.ranks[1:]]

    @property
    def leader(self) -> Any:
        """Rank 0's actor handle."""
        return self.ranks[0]

    def generate(self, prompt: str, drafter: Any, sampling: Any, chat: bool = False) -> dict:
        import ray

        return ray.get(self.leader.generate.remote(prompt, drafter, sampling, chat))

    def restart(self) -> None:
        """A rank died: kill every rank and the group, then start the replica anew."""
        self.restarts += 1
        self.kill()
        self._start()

    def close(self) -> None:
        """Close rank 0's stores (a job's), stop the followers, then the actors and the group."""
        import ray

        try:
            if self.job is not None:
                ray.get(self.leader.close_stores.remote())
            ray.get(self.leader.close.remote())
            ray.get(self.following)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every rank and remove the group (idempotent)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.ranks:
            ray.kill(actor)
        self.ranks = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


class TensorParallelLeader:
    """This process as rank 0 of a group whose other ranks are Ray actors: for the edges whose
    runner lives in this process (`tts solve`, a Serve replica), which decode with `generator`
    and `decoder` as with one process's. Inside a placement group (a Serve replica's: bundle 0
    is this process) follower r goes to bundle r."""

    def __init__(self, cfg: ModelConfig, ranks: int, cpus_per_rank: float = 1.0) -> None:
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = _gpus_per_rank(cfg)
        group = get_current_placement_group()
        remote = ray.remote(TensorParallelRank)
        self.followers = [
            remote.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus,
                **(
                    {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, r)}
                    if group is not None
                    else {}
                ),
            ).remote(cfg, r, ranks)
            for r in range(1, ranks)
        ]
        address = _address()
        setups = [a.setup.remote(address) for a in self.followers]
        try:
            self.loaded = _join(cfg, address, 0, ranks)
            ray.get(setups)
        except BaseException:
            self._end()
            raise
        self.following = [a.follow.remote() for a in self.followers]
        self.generator, self.decoder = _lead(cfg, self.loaded)

    def dead(self) -> bool:
        """Has a follower's loop ended (its rank died, or the group broke)?"""
        import ray

        return bool(ray.wait(self.following, timeout=0)[0])

    def close(self) -> None:
        """Stop the followers' loops, then the actors and this process's group."""
        import ray

        from tts_service.engine.tp import stop

        try:
            if not self.dead():
                stop(self.decoder)
                ray.get(self.following)
        finally:
            self._end()

    def _end(self) -> None:
        import ray
        import torch.distributed as dist

        for actor in self.followers:
            ray.kill(actor)
        if dist.is_initialized():
            dist.destroy_process_group()
