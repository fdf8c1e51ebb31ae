"""Peer copies: this host's steps pushed to its targets (:mod:`.replication`), copies
arriving (:mod:`.transfers`) and held for other hosts, proven their origin's
(:mod:`.provenance`), received (:mod:`.receive`: dedupe, proof, fence, reserve,
commit), read again and healed (:mod:`.scrub`) and collected (:mod:`.gc`). Runs in
the replicator process; reaches peers through ``transport.py``, never ``wire/``."""
