"""Restore-after-failure tests of your own training code, on one machine.

A local cluster of simulated hosts (each its own sidecar and ``mtc-replicator``
processes, a RAM disk of its own) that a test starts as a pytest fixture
(``mtc_cluster``) or a context manager (:func:`local_cluster`); faults as calls
(:meth:`TestCluster.kill_host`, ``wipe_ram_disk``, ``kill_replicator``,
``lose_slice``, ``partition``, ``restart_host``); waits on what the replicators
report (``wait_replicated``, ``wait_backed_up``); and the assertions such a test
makes (:func:`assert_tiers`, :func:`assert_same_values`). docs/testing.md walks
through one test. Install with ``pip install 'mtc[testing]'``.
"""

from mtc.testing.checks import (
    Restore,
    assert_same_values,
    assert_tiers,
    record_restores,
    use_cpu_devices,
)
from mtc.testing.cluster import ScriptError, TestCluster, local_cluster, options_from_env

__all__ = [
    "Restore",
    "ScriptError",
    "TestCluster",
    "assert_same_values",
    "assert_tiers",
    "local_cluster",
    "options_from_env",
    "record_restores",
    "use_cpu_devices",
]
