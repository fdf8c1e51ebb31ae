"""Between replicators: the gRPC server and client and the data channel, which move
bytes and requests only (the transport seam, ``transport.py``, over gRPC and the
data channel: :mod:`.grpc_peer`), and who may call (:mod:`.security`), with what
(``checks.py``, :mod:`.limits`). Runs in the replicator process; the controller
and the host sidecar use its client (:mod:`.client`). What both sides share lives
in ``mtc/``: the credentials (:mod:`mtc.credentials`), the certificates' names as
ranks (:mod:`mtc.rank_names`), errors as gRPC statuses (:mod:`mtc.grpc_errors`)."""
