"""The colocated calls' small answers: a request to every worker, and each worker's
reply read from its own shard of a fixed-size answer (one CPU device per worker).

A reply that outgrows the fixed size comes by a second call, padded to a size
class shared by the call (one specialization per class). A worker that failed
answers FAILED, and its typed error (step, host, file) is fetched by one more
request. Only these answers' bytes are read in the controller's process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mtc.contract import ERROR_REQUEST, FAILED, decode_reply, unframe
from mtc.dispatch.protocol import WorkerLostError
from mtc.errors import HostAgentError


class Answers:
    """``remote``: the workers' colocated object; ``ranks``: an array with one element
    per worker (its rank), on one CPU device each, whose sharding the answers
    take; ``rank_of``: each CPU device's host; ``invoke``: how a call is made (and
    counted). ``read_bytes``: the answers' bytes read here."""

    def __init__(self, remote: Any, ranks: jax.Array, rank_of: dict[Any, int],
                 invoke: Callable[..., Any]) -> None:
        from mtc.sidecar.colocated import ANSWER_BYTES

        self._remote = remote
        self._ranks = ranks
        self._rank_of = rank_of
        self._invoke = invoke
        mesh: Any = ranks.sharding.mesh  # type: ignore[attr-defined]
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._per_worker = ranks.sharding
        self._workers = mesh.devices.size
        self.size = ANSWER_BYTES
        self.read_bytes = 0
        # The ask function and its size argument per answer size, and the reply
        # function per size class: one specialization each.
        self._askers: dict[int, tuple[Any, jax.Array]] = {}
        self.fetchers: dict[int, Any] = {}

    def _spec(self, size: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self._workers * size,), np.dtype(np.uint8),
                                    sharding=self._per_worker)

    def _size_arg(self, size: int) -> jax.Array:
        return jax.device_put(np.array([size], "<u8").view(np.uint8), self._replicated)

    def _asker(self, size: int) -> tuple[Any, jax.Array]:
        got = self._askers.get(size)
        if got is None:
            spec = self._spec(size)
            got = self._askers[size] = (self._remote.ask.specialize(out_specs_fn=lambda *_: spec),
                                        self._size_arg(size))
        return got

    def shards(self, answer: jax.Array, op: str) -> list[tuple[int, np.ndarray]]:
        """Each worker's shard of a call's answer, with its rank (host); a shard
        whose worker was lost with its host raises :class:`WorkerLostError`."""
        out = []
        for s in answer.addressable_shards:
            rank = self._rank_of[s.device]
            try:
                out.append((rank, np.asarray(s.data)))
            except jax.errors.JaxRuntimeError as e:
                raise WorkerLostError(f"{op}: the worker's answer cannot be read: {e}",
                                      host=rank) from e
        return out

    def exchange(self, request: bytes, size: int | None = None) -> list[Any]:
        """Each worker's reply to ``request``, in rank order: whole in the fixed-size
        answer (``size`` bytes per worker, default :attr:`size`) when it fits,
        else fetched by a second call."""
        size = size or self.size
        ask, size_arg = self._asker(size)
        raw = jax.device_put(np.frombuffer(request, np.uint8), self._replicated)
        whole: dict[int, bytes] = {}
        size_of: dict[int, int] = {}
        for rank, buf in self.shards(self._invoke(ask, raw, self._ranks, size_arg), "ask"):
            n, payload = unframe(buf)
            size_of[rank] = n
            self.read_bytes += min(n, size - 8)
            if payload is not None:
                whole[rank] = payload
        longer = [r for r in size_of if r not in whole]
        if longer:
            cap = 1 << (max(size_of[r] for r in longer) - 1).bit_length()
            fetch = self.fetchers.get(cap)
            if fetch is None:
                spec = self._spec(cap)
                fetch = self.fetchers[cap] = self._remote.reply.specialize(
                    out_specs_fn=lambda *_: spec)
            got = self._invoke(fetch, self._ranks, self._size_arg(cap))
            for rank, buf in self.shards(got, "reply"):
                if rank in longer:
                    whole[rank] = buf[:size_of[rank]].tobytes()
                    self.read_bytes += size_of[rank]
        return [decode_reply(whole[r]) for r in sorted(whole)]

    def unanimous(self, answer: jax.Array, op: str) -> bool:
        """Every worker's answer, read from its own shard; they must agree. A worker
        that failed answers FAILED: its typed error (step, host, file) is fetched."""
        values = {int(buf.reshape(-1)[0]) for _, buf in self.shards(answer, op)}
        if FAILED in values:
            self.raise_worker_error(op)
        if len(values) != 1:
            raise HostAgentError(f"{op}: workers answered differently: {sorted(values)}")
        return bool(values.pop())

    def raise_worker_error(self, op: str) -> None:
        self.exchange(ERROR_REQUEST)  # raises the typed error
        raise HostAgentError(f"{op}: a worker failed and kept no error")
