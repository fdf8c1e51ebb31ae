"""The sidecar process of one host (the local cluster's colocated-Python sidecar)."""
