"""Host-side code: writes one host's shards to its RAM disk and reads them back.

The same code runs in the colocated-Python sidecar on a Pathways worker, in each
process of multi-controller JAX, and for simulated hosts on one machine.

- ``save/``: a save's shards staged into host memory, written, committed;
- ``restore/``: a restore's regions read, verified and put on devices;
- ``storage/``: the renames, checksums, reserve and quarantine of every host
  process;
- ``replicator/``: the per-host process that copies steps to peers and agrees
  on the step to restore; ``backup/``: its copies to cloud storage;
- ``host/``: the local cluster's sidecar process;
- at the top, what serves both: ``ops.py`` (every other host operation),
  ``colocated.py`` (the colocated-Python worker class), ``confine.py`` (paths
  opened without following symlinks), ``priority.py``, ``dtypes.py``.
"""
