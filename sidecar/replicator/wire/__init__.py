"""Between replicators: the gRPC server and client and the data channel, which move
bytes and requests only, and who may call (:mod:`.security`, :mod:`.rank_names`),
with what (:mod:`.checks`, :mod:`.limits`). Runs in the replicator process; the
controller and the host sidecar use its client and credentials."""
