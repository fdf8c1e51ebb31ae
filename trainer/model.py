"""A small decoder-only transformer LM in plain JAX, with its optimizer and shardings.

Parameters are sharded Megatron-style over the mesh axis ``model`` (attention
heads and MLP hidden units split across devices); the batch is split over
``replica`` (data parallel across slices). XLA inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtc.elastic.taken import step_copy_memory_kind
from mtc.trainer import aot

# Captured at import: a trainer built while pathwaysutils' fault simulator has
# ``jax.jit`` patched still gets a real jitted function (one that can be lowered
# ahead of time). Failures are still detected where arrays are read.
_jit = jax.jit

Params = dict[str, Any]
State = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Config:
    """The model and its optimizer; the defaults are the ``small`` preset (3.2M parameters)."""

    vocab_size: int = 16
    seq_len: int = 64
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.1
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 150
    weight_decay: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Config:
        """``small`` (3.2M parameters, about 0.25 s a step on 2 CPU cores) or ``tiny``
        (0.4M, 60 ms: what the tests train)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, int]] = {
    "small": {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024},
    "tiny": {"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512},
}


def init_params(cfg: Config, seed: int) -> Params:
    """Initial parameters as host numpy arrays (no XLA program to compile)."""
    d, h, hd, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones((n,), np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros((n,), np.float32)

    out_std = 1 / math.sqrt(2 * cfg.n_layers)
    layers = [{
        "ln1": ones(d),
        "wqkv": normal((d, 3, h, hd), 1 / math.sqrt(d)),
        "wo": normal((h, hd, d), out_std / math.sqrt(d)),
        "ln2": ones(d),
        "w1": normal((d, f), 1 / math.sqrt(d)),
        "b1": zeros(f),
        "w2": normal((f, d), out_std / math.sqrt(f)),
        "b2": zeros(d),
    } for _ in range(cfg.n_layers)]
    return {
        "embed": normal((cfg.vocab_size, d), 0.02),
        "pos": normal((cfg.seq_len, d), 0.02),
        "layers": layers,
        "ln_f": ones(d),
        "unembed": normal((d, cfg.vocab_size), 1 / math.sqrt(d)),
    }


def param_specs(cfg: Config) -> Params:
    """PartitionSpecs of the parameters: heads and MLP units over ``model``."""
    layer = {
        "ln1": P(), "wqkv": P(None, None, "model", None), "wo": P("model", None, None),
        "ln2": P(), "w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(),
    }
    return {
        "embed": P(None, "model"), "pos": P(None, "model"),
        "layers": [dict(layer) for _ in range(cfg.n_layers)],
        "ln_f": P(), "unembed": P("model", None),
    }


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def forward(params: Params, tokens: jax.Array, cfg: Config, key: jax.Array | None) -> jax.Array:
    """Logits ``[B, T, vocab]`` of ``tokens [B, T]``; dropout only when ``key`` is given."""
    t = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    drop_keys: list[jax.Array | None] = (
        list(jax.random.split(key, 2 * cfg.n_layers)) if key is not None
        else [None] * (2 * cfg.n_layers))
    for i, lp in enumerate(params["layers"]):
        h = _layer_norm(x, lp["ln1"])
        q, k, v = jnp.einsum("btd,dchk->cbthk", h, lp["wqkv"])
        att = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(cfg.head_dim)
        att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
        o = jnp.einsum("bhts,bshk->bthk", att, v)
        x = x + _dropout(jnp.einsum("bthk,hkd->btd", o, lp["wo"]), cfg.dropout, drop_keys[2 * i])
        h = _layer_norm(x, lp["ln2"])
        h = jax.nn.gelu(h @ lp["w1"] + lp["b1"]) @ lp["w2"] + lp["b2"]
        x = x + _dropout(h, cfg.dropout, drop_keys[2 * i + 1])
    return _layer_norm(x, params["ln_f"]) @ params["unembed"]


def loss_fn(params: Params, batch: jax.Array, cfg: Config, key: jax.Array | None) -> jax.Array:
    """Mean next-character cross-entropy (nats) of ``batch [B, T+1]``."""
    logits = forward(params, batch[:, :-1], cfg, key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.total_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay))


def state_shardings(cfg: Config, mesh: Mesh, abstract: State) -> State:
    """NamedShardings of the array leaves of a train state (``None`` for plain values).

    The optimizer's per-parameter moments follow their parameter; its counters
    are replicated.
    """
    specs = param_specs(cfg)
    replicated = NamedSharding(mesh, P())
    param_sh = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, P))
    opt_sh = optax.tree_map_params(
        make_optimizer(cfg), lambda _, s: s, abstract["opt_state"], param_sh,
        transform_non_params=lambda _: replicated)
    return {"params": param_sh, "opt_state": opt_sh, "rng": replicated,
            "step": None, "data": None}


class Trainer:
    """The compiled train step for one mesh; the state is a plain pytree.

    ``state = {"params", "opt_state", "rng", "step": int, "data": {...}}``, where
    ``rng`` is split on every step (so it must be checkpointed for the run to
    continue exactly) and ``data`` is the input iterator's state.

    Every program runs as an ahead-of-time ``Compiled`` executable (:mod:`mtc.trainer.aot`),
    built on first use or earlier by :meth:`prepare` from any thread (a build
    another thread has started is waited for, never repeated). :attr:`uses`
    records, per program, whether its first run found it ready, cached or compiled.
    Threads: :meth:`prepare` and :meth:`warm_up` may run on any thread (the
    compile-ahead one); the step methods and :attr:`uses` belong to the loop.
    ``_lock`` guards ``_builds``; ``_exe`` only ever gains entries.
    """

    ARRAYS = ("params", "opt_state", "rng")
    PROGRAMS = ("step", "snapshot", "wrap_rng")

    def __init__(self, cfg: Config, mesh: Mesh, *, batch_size: int = 16) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self.batch_size = batch_size
        self.optimizer = make_optimizer(cfg)
        self.batch_sharding = NamedSharding(mesh, P("replica"))
        shapes = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_params(cfg, 0))
        self._abstract = {"params": shapes,
                          "opt_state": jax.eval_shape(self.optimizer.init, shapes),
                          "rng": jax.eval_shape(jax.random.key, 0)}
        self.shardings = state_shardings(cfg, mesh, self._abstract)
        self._array_sh = {k: self.shardings[k] for k in self.ARRAYS}
        self.replicated = NamedSharding(mesh, P())
        self._jitted: dict[str, Any] = {}
        self._jitted["step"] = _jit(
            self._train_step,
            in_shardings=(self._array_sh, self.batch_sharding),
            out_shardings=(self._array_sh, self.replicated),
            donate_argnums=0)
        # The snapshot the step emits: its new state once more, in host memory
        # where the platform has it (on TPU and GPU the copy is a DMA inside the
        # step; on CPU a second buffer in device memory, which is RAM too). Never
        # donated, so it stays valid while the next step runs in place.
        kind = step_copy_memory_kind(mesh.devices.flat)
        self.snapshot_shardings = {
            "params": _with_kind(self.shardings["params"], kind),
            "opt_state": _with_kind(self.shardings["opt_state"], kind),
            "rng": _with_kind(self.shardings["rng"], kind)}
        self._jitted["snapshot"] = _jit(
            self._train_step_snapshot,
            in_shardings=(self._array_sh, self.batch_sharding),
            out_shardings=(self._array_sh, self.replicated, self.snapshot_shardings),
            donate_argnums=0)
        # A restored key's data becomes a key on this mesh (a small program of its own).
        self._key_data = jax.eval_shape(jax.random.key_data, self._abstract["rng"])
        self._jitted["wrap_rng"] = _jit(jax.random.wrap_key_data, in_shardings=self.replicated,
                                        out_shardings=self.shardings["rng"])
        self._lock = threading.Lock()
        self._builds: dict[str, Future[tuple[Any, aot.Built]]] = {}
        self._exe: dict[str, Any] = {}  # the built executables, read lock-free by the loop
        self.uses: dict[str, aot.Use] = {}

    # -- executables ---------------------------------------------------------------

    def _abstract_args(self, program: str) -> tuple[Any, ...]:
        if program == "wrap_rng":
            return (jax.ShapeDtypeStruct(self._key_data.shape, self._key_data.dtype,
                                         sharding=self.replicated),)
        arrays = {k: v for k, v in self.abstract_state().items() if k in self.ARRAYS}
        batch = jax.ShapeDtypeStruct((self.batch_size, self.cfg.seq_len + 1), np.int32,
                                     sharding=self.batch_sharding)
        return arrays, batch

    def prepare(self, program: str, *, ahead: bool = False, nice: int = 0) -> aot.Built:
        """Build ``program``'s executable unless it is built or being built
        (then wait for that build); returns how it was built. ``nice``: compile
        at that much lower priority (see :func:`aot.lowered_priority`)."""
        with self._lock:
            fut = self._builds.get(program)
            mine = fut is None
            if fut is None:
                fut = self._builds[program] = Future()
        if mine:
            try:
                exe, built = aot.build(self._jitted[program], *self._abstract_args(program),
                                       ahead=ahead, nice=nice)
            except BaseException as e:
                with self._lock:
                    del self._builds[program]
                fut.set_exception(e)
                raise
            self._exe[program] = exe
            fut.set_result((exe, built))
        return fut.result()[1]

    def warm_up(self, program: str) -> float:
        """Run ``program`` (prepared) once on zeros (inputs donated, outputs dropped):
        an executable's first run on this platform costs more than the later ones
        (first-touch memory, lazily set-up kernels), and that first run should
        not be the first step after a failure. Returns the seconds it took."""
        t0 = time.perf_counter()
        exe = self.executable(program) if program == "wrap_rng" else self._exe[program]

        def zeros(a: jax.ShapeDtypeStruct) -> jax.Array:
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                return self.wrap_rng(jax.device_put(
                    np.zeros(self._key_data.shape, self._key_data.dtype), self.replicated))
            return jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)

        args = jax.tree_util.tree_map(zeros, self._abstract_args(program))
        jax.block_until_ready(exe(*args))
        return time.perf_counter() - t0

    def built(self, program: str) -> aot.Built | None:
        """How ``program`` was built, once it is."""
        fut = self._builds.get(program)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()[1]

    def ready(self, program: str) -> bool:
        return program in self._exe

    def executable(self, program: str) -> Any:
        """The executable, built now if nothing built it before; the first call
        records the :class:`aot.Use`."""
        exe = self._exe.get(program)
        if exe is not None and program in self.uses:
            return exe
        t0 = time.perf_counter()
        was_ready = exe is not None
        with self._lock:
            pending = program in self._builds
        built = self.prepare(program)
        waited = time.perf_counter() - t0
        if program not in self.uses:
            source = aot.READY if was_ready or (pending and built.ahead) else built.source
            self.uses[program] = aot.Use(source, built.seconds, built.ahead,
                                         0.0 if was_ready else waited)
        return self._exe[program]

    # -- the programs --------------------------------------------------------------

    def _train_step(self, arrays: State, batch: jax.Array) -> tuple[State, jax.Array]:
        rng, dropout_key = jax.random.split(arrays["rng"])
        loss, grads = jax.value_and_grad(loss_fn)(arrays["params"], batch, self.cfg, dropout_key)
        updates, opt_state = self.optimizer.update(grads, arrays["opt_state"], arrays["params"])
        params = optax.apply_updates(arrays["params"], updates)
        return {"params": params, "opt_state": opt_state, "rng": rng}, loss

    def _train_step_snapshot(self, arrays: State, batch: jax.Array
                             ) -> tuple[State, jax.Array, dict[str, Any]]:
        new, loss = self._train_step(arrays, batch)
        snap = {"params": new["params"], "opt_state": new["opt_state"],
                "rng": jax.random.key_data(new["rng"])}
        return new, loss, snap

    def init(self, seed: int) -> State:
        """A fresh state, built on the host and placed onto the mesh."""
        params = init_params(self.cfg, seed)
        opt_state = jax.tree_util.tree_map(np.asarray, self.optimizer.init(params))
        arrays = jax.device_put({"params": params, "opt_state": opt_state},
                                {k: self._array_sh[k] for k in ("params", "opt_state")})
        key_data = jax.device_put(jax.random.key_data(jax.random.key(seed)), self.replicated)
        rng = self.wrap_rng(key_data)
        return {**arrays, "rng": rng, "step": 0, "data": {"global_next_index": 0}}

    def wrap_rng(self, key_data: jax.Array) -> jax.Array:
        """The PRNG key whose data ``key_data`` (replicated on this mesh) holds."""
        return self.executable("wrap_rng")(key_data)

    def abstract_state(self) -> State:
        """The restore target: ShapeDtypeStructs with shardings, placeholders for values."""
        target = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self._abstract, self._array_sh)
        return {**target, "step": 0, "data": {"global_next_index": 0}}

    def _batch(self, batch: Any) -> jax.Array:
        if batch.shape[0] != self.batch_size:
            raise ValueError(f"batch of {batch.shape[0]}, this trainer is built for "
                             f"{self.batch_size}")
        return jax.device_put(batch, self.batch_sharding)

    def step(self, state: State, batch: Any) -> tuple[State, jax.Array]:
        """One optimizer step on a host batch ``int32[B, T+1]``; donates ``state``'s arrays."""
        arrays = {k: state[k] for k in self.ARRAYS}
        new, loss = self.executable("step")(arrays, self._batch(batch))
        return {**new, "step": state["step"] + 1, "data": state["data"]}, loss

    def step_with_snapshot(self, state: State, batch: Any
                           ) -> tuple[State, jax.Array, dict[str, Any]]:
        """:meth:`step`, also returning a copy of the new arrays that no later step
        donates (``rng`` as its key data), placed per :attr:`snapshot_shardings`."""
        arrays = {k: state[k] for k in self.ARRAYS}
        new, loss, snap = self.executable("snapshot")(arrays, self._batch(batch))
        return {**new, "step": state["step"] + 1, "data": state["data"]}, loss, snap

    def state_of_copies(self, state: State, copies: dict[str, Any]) -> State:
        """``state`` with its arrays taken from the copies :meth:`step_with_snapshot`
        made of them, which no later step donates (in host memory where the
        platform has it): what a save reads while the next step runs in place."""
        rng = jax.random.wrap_key_data(copies["rng"], impl=jax.random.key_impl(state["rng"]))
        return {**state, **{k: copies[k] for k in self.ARRAYS if k != "rng"}, "rng": rng}


def _with_kind(shardings: Any, kind: str | None) -> Any:
    if kind is None:
        return shardings
    return jax.tree_util.tree_map(lambda s: s.with_memory_kind(kind), shardings,
                                  is_leaf=lambda x: isinstance(x, NamedSharding))
