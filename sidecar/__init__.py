"""Host-side code: writes one host's shards to its RAM disk and reads them back.

The same code runs in the colocated-Python sidecar on a Pathways worker, in each
process of multi-controller JAX, and for simulated hosts on one machine.
"""
