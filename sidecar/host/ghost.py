"""``python -m mtc.sidecar.host.ghost ADDRESS N``: the rest of the job, as one worker sees it.

A Pathways worker's colocated-Python sidecar runs a JAX whose devices are the
whole job's, only its own addressable: an input is a global array of which it
holds its own shards. The local cluster's sidecar gets that view by being
process 1 of a two-process CPU job whose process 0 is this one, holding the
``N`` devices of the other hosts. It hosts the job's coordination service,
computes nothing and serves no one; it dies with the sidecar that started it
(``PR_SET_PDEATHSIG``), which also kills it when closing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1
TIMEOUT_S = 60
NEVER_S = 10**7  # no heartbeat deadline: a missed one would end the sidecar's JAX


def _start_from_jaxlib(address: str, n: int) -> list[Any] | None:
    """Process 0 started from jaxlib alone: what ``jax.distributed.initialize`` and
    the first ``jax.devices()`` do for it (the coordination service on the
    address's port, its client, the preemption sync manager, the CPU client whose
    ``n`` devices join the topology exchange), without importing jax, which costs
    a fifth as much CPU (0.17 s, not 0.87 s, 2026-12-07) in every colocated
    host's start. Returns what must stay alive; None where this jaxlib lacks one of
    the calls (jax then does it all, as :func:`main` did before)."""
    try:
        from jaxlib import _jax, xla_client
    except ImportError:
        return None
    needed = ("get_distributed_runtime_service", "get_distributed_runtime_client",
              "make_gloo_tcp_collectives", "create_preemption_sync_manager")
    if not all(hasattr(_jax, name) for name in needed) or not hasattr(
            xla_client, "make_cpu_client"):
        return None
    port = address.rsplit(":", 1)[1]
    # Bound as jax binds it by default ([::]:port, every address).
    service = _jax.get_distributed_runtime_service(
        f"[::]:{port}", 2, heartbeat_timeout=NEVER_S, shutdown_timeout=1)
    try:
        client = _jax.get_distributed_runtime_client(
            address, 0, init_timeout=TIMEOUT_S, use_compression=True,
            heartbeat_timeout=NEVER_S)
        client.connect()
        sync = _jax.create_preemption_sync_manager()
        sync.initialize(client)
        cpu = xla_client.make_cpu_client(
            distributed_client=client, node_id=0, num_nodes=2, num_devices=n,
            collectives=_jax.make_gloo_tcp_collectives(distributed_client=client))
    except TypeError:  # a jaxlib whose calls take other arguments: jax does it all
        service.shutdown()
        return None
    return [service, client, sync, cpu]


def main() -> None:
    address, n = sys.argv[1], int(sys.argv[2])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the sidecar died before the line above
        return
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # as jax sets it: no INFO lines
    held = _start_from_jaxlib(address, n)
    if held is not None:
        threading.Event().wait()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(address, num_processes=2, process_id=0,
                               initialization_timeout=TIMEOUT_S,
                               heartbeat_timeout_seconds=NEVER_S, shutdown_timeout_seconds=1)
    jax.devices()  # the topology exchange: the sidecar's JAX starts once it is done
    threading.Event().wait()


if __name__ == "__main__":
    main()
