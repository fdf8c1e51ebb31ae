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

PR_SET_PDEATHSIG = 1
TIMEOUT_S = 60
NEVER_S = 10**7  # no heartbeat deadline: a missed one would end the sidecar's JAX


def main() -> None:
    address, n = sys.argv[1], int(sys.argv[2])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the sidecar died before the line above
        return
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(address, num_processes=2, process_id=0,
                               initialization_timeout=TIMEOUT_S,
                               heartbeat_timeout_seconds=NEVER_S, shutdown_timeout_seconds=1)
    jax.devices()  # the topology exchange: the sidecar's JAX starts once it is done
    threading.Event().wait()


if __name__ == "__main__":
    main()
