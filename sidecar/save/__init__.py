"""A save on one host, after the controller's ``stage`` reached it: its shards
taken into host memory, written to the RAM disk with their CRC32C, the manifest
last, and the step committed by one rename.

- :mod:`.agent`: the host agent; takes the host's distinct shards into host
  memory (device-to-host copies) and hands them to the writer;
- :mod:`.buffers`: the byte-budgeted pool of host staging buffers;
- :mod:`.write`: the writer; shard files, checksums, manifest, and the commit
  (a rename through :mod:`mtc.sidecar.storage.publish`).

Run by the host side: the colocated-Python sidecar of a Pathways worker, each
process of multi-controller JAX, or the controller's own process when it plays
simulated hosts (``mtc.dispatch.LocalDispatch``). Never by the replicator, which
only copies steps this code committed.
"""
