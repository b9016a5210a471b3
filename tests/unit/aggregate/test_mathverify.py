"""The math-verify child: a hung request is killed and replaced, threads work, and a child that
cannot start fails loudly instead of turning every answer into None."""

from __future__ import annotations

import threading
import time

import pytest

from tts_service.aggregate import mathverify


def test_hung_request_is_killed_and_the_next_one_gets_a_fresh_child():
    start = time.monotonic()
    assert mathverify.equal("2^{2^{2^{2^{2^{5}}}}}", "3", timeout_s=2) is False  # sympy hangs
    assert time.monotonic() - start < 10
    assert mathverify.equal("1/2", "0.50", timeout_s=30)
    assert mathverify.extract("The final answer is 32.", timeout_s=30) == "32"


def test_works_off_the_main_thread():
    """math-verify's own timeouts use signals, which fail outside the main thread (Ray, Serve)."""
    results: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(mathverify.equal(f"{i}/4", str(i / 4), 30))
        )
        for i in range(1, 5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


def test_a_child_that_cannot_start_raises(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mathverify.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="math-verify"):
        mathverify._Child().request({"op": "extract", "text": "1"}, timeout_s=5)
