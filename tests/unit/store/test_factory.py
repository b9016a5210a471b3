"""The store factory: the URL's scheme picks the backend, and a global scope is shared by the
problems that ask for it."""

from __future__ import annotations

import pytest

from store.base import NgramRow
from store.config import StoreConfig
from store.factory import check_store, open_global_store, open_problem_store, open_store
from store.local_server import free_port
from store.memory import InMemoryNgramStore
from store.redis_store import RedisLogitNgramStore


def test_factory_picks_the_backend_by_url_scheme():
    cfg = StoreConfig(fallback=True)  # no server here: a Redis store starts degraded
    assert isinstance(open_store(cfg, None, "problem", "p"), InMemoryNgramStore)
    port = free_port()
    for url in (f"redis://127.0.0.1:{port}/0", f"rediss://127.0.0.1:{port}/0", "unix:///no.sock"):
        assert isinstance(open_store(cfg, url, "problem", "p"), RedisLogitNgramStore)
    for url in ("local-redis", "http://127.0.0.1:6379"):  # the edges resolve 'local-redis'
        with pytest.raises(ValueError, match="known: redis://, rediss://, unix://"):
            open_store(cfg, url, "problem", "p")


def test_factory_global_scope_is_shared_by_the_problems_that_ask_for_it():
    assert open_global_store(StoreConfig(), None) is None  # off by default
    cfg = StoreConfig(global_scope=True)
    glob = open_global_store(cfg, None)
    first = open_problem_store(cfg, None, "p1", glob)
    first.add([NgramRow((4,), (8,), (1.0,))])
    second = open_problem_store(cfg, None, "p2", glob)
    assert second.lookup([4]).ids == (8,)  # learned by p1, read through the global scope
    assert open_problem_store(cfg, None, "p3").lookup([4]) is None  # no global: nothing


@pytest.mark.parametrize(
    "url", ["redis+cluster://h:70000", "redis+cluster://hx", "redis+cluster://:1"]
)
@pytest.mark.parametrize("fallback", [False, True])
def test_a_malformed_cluster_url_is_named_before_anything_connects(url, fallback):
    """The edges turn it into exit 2 (`tts solve --store`) or a job input error, never a
    traceback; with a fallback too, which would otherwise fail at the first connect."""
    with pytest.raises(ValueError, match="expected host:port"):
        check_store(StoreConfig(fallback=fallback), url)
