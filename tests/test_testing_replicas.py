"""mtc.testing.replicas: which copies make a step replicated (the replicators'
own placement, ``ReplicatorConfig.targets``), and the bounded wait on them
(``held`` here is a list of answers, as the harnesses' inventories give)."""

from __future__ import annotations

import pytest

from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.testing.replicas import peer_copies, unreplicated, wait_replicated

Copy = tuple[int, int, int]


@pytest.mark.parametrize(("hosts", "per_slice", "want"), [
    (2, 1, {(1, 0, 7), (0, 1, 7)}),
    (4, 2, {(2, 0, 7), (3, 1, 7), (0, 2, 7), (1, 3, 7)}),
    (6, 3, {(3, 0, 7), (4, 1, 7), (5, 2, 7), (0, 3, 7), (1, 4, 7), (2, 5, 7)}),
    # three slices: each host's copy is in the next slice, the last slice's in the first
    (6, 2, {(2, 0, 7), (3, 1, 7), (4, 2, 7), (5, 3, 7), (0, 4, 7), (1, 5, 7)}),
])
def test_each_hosts_copy_is_on_the_host_a_slice_on(hosts: int, per_slice: int,
                                                   want: set[Copy]) -> None:
    assert peer_copies(7, hosts, per_slice) == want


@pytest.mark.parametrize(("hosts", "per_slice", "replicas"),
                         [(2, 1, 1), (4, 2, 1), (6, 2, 1), (6, 2, 2), (8, 2, 3), (4, 1, 2)])
def test_the_copies_are_where_the_replicators_push(hosts: int, per_slice: int,
                                                   replicas: int) -> None:
    nodes = tuple(f"h{r}:1" for r in range(hosts))
    pushed = {(t, r, 3) for r in range(hosts)
              for t in ReplicatorConfig(r, nodes, per_slice, replicas=replicas).targets(r)}
    assert peer_copies(3, hosts, per_slice, replicas) == pushed


@pytest.mark.parametrize(("held", "missing"), [
    (set(), [0, 1, 2, 3]),
    # each host's own copy does not count
    ({(h, h, 5) for h in range(4)}, [0, 1, 2, 3]),
    ({(2, 0, 5), (3, 1, 5), (0, 2, 5), (1, 3, 5)}, []),
    # host 1 holds host 0's step: the same slice, it does not count
    ({(1, 0, 5), (3, 1, 5)}, [0, 2, 3]),
    # host 3 holds host 0's step: another slice, but not host 0's peer (host 2)
    ({(3, 0, 5), (3, 1, 5), (0, 2, 5), (1, 3, 5)}, [0]),
    ({(0, 2, 4), (0, 3, 5), (2, 0, 5), (3, 1, 5)}, [2, 3]),  # another step is not this one
])
def test_unreplicated(held: set[Copy], missing: list[int]) -> None:
    assert unreplicated(held, 5, 4, 2) == missing


def test_the_wait_ends_once_every_copy_is_held() -> None:
    answers: list[set[Copy]] = [set(), {(1, 0, 7)}, {(1, 0, 7), (0, 1, 7), (0, 1, 6)}]
    asked: list[int] = []

    def held() -> set[Copy]:
        asked.append(1)
        return answers[min(len(asked), len(answers)) - 1]

    assert wait_replicated(held, 7, 2, 1, timeout=5.0, poll_s=0.001) >= 0
    assert len(asked) == 3  # not before the last copy came


def test_a_copy_that_never_comes_is_named_after_the_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"step 7 of hosts \[1\] .*\[\(0, 1, 7\)\]"):
        wait_replicated(lambda: {(1, 0, 7), (0, 1, 6)}, 7, 2, 1, timeout=0.05, poll_s=0.01)


def test_the_timeout_names_the_hosts_that_answer_nothing() -> None:
    """The second newcomer trial: with host 3's replicator killed, ``wait_replicated``
    said ``step 20 of hosts [1, 3] is not on its peer`` and nothing of host 3 being
    the one down. The hosts whose replicator did not answer are named apart."""
    held = {(0, 2, 20), (2, 0, 20)}  # host 3's replicator down: nothing of 1 or 3
    with pytest.raises(TimeoutError) as e:
        wait_replicated(lambda: held, 20, 4, 2, timeout=0.05, poll_s=0.01,
                        silent=lambda: [3])
    assert "step 20 of hosts [1, 3] is not on its peer" in str(e.value), e.value
    assert str(e.value).endswith("; host(s) [3] answer nothing: down, or their "
                                 "replicator is"), e.value


def test_mtc_testing_reaches_the_hosts_through_mtc_not_the_sidecars_modules() -> None:
    """mtc.testing runs in the test's process, the controller's side: it asks the
    replicators over the network (mtc.replicas) and takes shared definitions from
    mtc/. The one exception, until the replicator's shared definitions move to mtc/:
    the placement rule, ``targets``."""
    import ast
    from pathlib import Path

    import mtc.testing

    allowed = {("mtc.sidecar.replicator.config", "targets")}
    found = set()
    for path in Path(mtc.testing.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtc.sidecar"):
                found |= {(node.module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.startswith("mtc.sidecar")}
    assert found <= allowed, sorted(found - allowed)


def test_wait_healthy_waits_for_the_answer_asked_and_ends_when_the_process_dies() -> None:
    """Every harness's "until serving" (mtc.testing.replicas.wait_healthy): the answer
    asked for, after a cheaper sign (``ready``) if any; a dead process ends it at once
    with its log; a timeout names the last answer."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from mtc.testing.replicas import health as health_of
    from mtc.testing.replicas import wait_healthy
    from mtc.testing.waits import WaitTimeout

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert health_of(address) == "NOT_SERVING"
        wait_healthy(address, lambda: True, None, lambda: "", 5, want="NOT_SERVING")
        with pytest.raises(WaitTimeout, match=r"health SERVING.*it answers NOT_SERVING: log"):
            wait_healthy(address, lambda: True, None, lambda: "log", 0.1, poll_s=0.01)
        with pytest.raises(RuntimeError, match="exited: its last words"):
            wait_healthy(address, lambda: False, None, lambda: "its last words", 5)
        asked: list[int] = []

        def ready() -> bool:  # the port file appears on the third stat, serving by then
            asked.append(1)
            if len(asked) == 3:
                servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            return len(asked) >= 3

        wait_healthy(address, lambda: True, None, lambda: "", 5, ready=ready, poll_s=0.001)
        assert len(asked) == 3  # no RPC asked before the sign, and done at the first
    finally:
        server.stop(None)
    assert health_of(address, timeout_s=0.5) == "UNAVAILABLE"
