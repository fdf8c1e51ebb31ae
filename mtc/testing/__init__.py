"""Restore-after-failure tests of your own training code, on one machine.

A local cluster of simulated hosts (each its own sidecar and ``mtc-replicator``
processes, a RAM disk of its own) that a test starts as a pytest fixture
(``mtc_cluster``) or a context manager (:func:`local_cluster`); faults as calls
(:meth:`TestCluster.kill_host`, ``wipe_ram_disk``, ``kill_replicator``,
``lose_slice``, ``partition``, ``restart_host``); waits on what the replicators
report (``wait_replicated``, ``wait_backed_up``); and the assertions such a test
makes (:func:`assert_tiers`, :func:`assert_same_values`). The code under test runs
in the test's process (the job's single controller), as a script
(:meth:`TestCluster.run_script`), or as a multi-controller job of one process per
host (:meth:`TestCluster.run_job`, :func:`join_job`). docs/testing.md walks
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
from mtc.testing.jobs import join_job

__all__ = [
    "Restore",
    "ScriptError",
    "TestCluster",
    "assert_same_values",
    "assert_tiers",
    "join_job",
    "local_cluster",
    "options_from_env",
    "record_restores",
    "use_cpu_devices",
]
