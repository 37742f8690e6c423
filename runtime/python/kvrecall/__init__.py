# SPDX-License-Identifier: MIT
"""kvrecall from Python: a long-context KV-cache runtime (FreeKV's speculative retrieval).

The package is the C API (``kvrecall.h``) in Python's habits:

- :class:`Config` — the context's configuration as keyword arguments, the C
  defaults, validated when created (``ValueError`` naming the field);
- :class:`Context` — a context (use it as a context manager) with sequences,
  prefill, prefill attention, decode steps, counters and traces;
- :class:`Sequence` — one request's KV cache (create, fork, truncate, free);
- ``DecodeStep`` — an open decode step (``ctx.decode_step(...)``): one
  ``step.layer(...)`` per layer, ended by leaving its ``with`` block;
- :class:`ThreadPool` — kvrecall's workers, to share between contexts.

Tensors are numpy arrays, torch tensors (CPU or CUDA) or anything with the
buffer protocol, ``__cuda_array_interface__`` or ``__dlpack__``; they are read
and written in place, never copied, and must be C-contiguous. Every call that
computes or waits releases the GIL. Errors are :class:`Error` exceptions with
``errno`` and kvrecall's own message (``InvalidArgument`` is also a
``ValueError``, ``OutOfMemory`` a ``MemoryError``). The transformers adapter
is :mod:`kvrecall.transformers`. docs/python.md has the long form.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence as _Seq, Union

from . import _kvrecall
from ._kvrecall import (
    Busy,
    DecodeStep,
    Error,
    InvalidArgument,
    NotSupported,
    OutOfMemory,
    SequenceError,
    ThreadPool,
)

__all__ = [
    "Busy",
    "Config",
    "Context",
    "DecodeStep",
    "Error",
    "InvalidArgument",
    "NotSupported",
    "OutOfMemory",
    "Sequence",
    "SequenceError",
    "ThreadPool",
    "__version__",
    "device_bytes_needed",
    "spill_dir_info",
    "system_info",
    "version",
]

__version__: str = _kvrecall.version()


def version() -> str:
    """The loaded library's version, "MAJOR.MINOR.PATCH"."""
    return _kvrecall.version()


def system_info() -> dict:
    """What this build and machine offer (``kvrecall info``): CUDA, GPUs, vector
    extensions and the cpu kernels in use, NUMA, memory, io_uring."""
    return _kvrecall.system_info()


def spill_dir_info(directory: Optional[str] = None) -> dict:
    """What a directory offers the spill tier (O_DIRECT, free bytes, file system)."""
    return _kvrecall.spill_dir_info(directory)


# Enum names, from the C library's own name functions (index = value).
_ENUM_FIELDS = ("mode", "dtype", "backend", "recall", "controller", "kv_format")
_ENUM_NAMES = {kind: _kvrecall.enum_names(kind) for kind in _ENUM_FIELDS}
_ENUM_NAMES["pool_layout"] = ["hnd", "nhd"]
_ENUM_NAMES["log_level"] = ["error", "warn", "info", "debug"]
_DTYPE_ALIASES = {
    "float16": "f16", "half": "f16", "torch.float16": "f16",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float32": "f32", "float": "f32", "torch.float32": "f32",
}
_THREADS_AUTO = _kvrecall.THREADS_AUTO
_TOKENS_AUTO = _kvrecall.TOKENS_AUTO
_TOKENS_FIELDS = ("sink_tokens", "window_tokens")
_NUMA_AUTO = _kvrecall.NUMA_NODE_AUTO


def _enum_value(field: str, value: Any) -> int:
    names = _ENUM_NAMES[field]
    if isinstance(value, bool):
        raise TypeError(f"Config: {field} must be one of {names}, got {value!r}")
    if isinstance(value, int):
        if not 0 <= value < len(names):
            raise InvalidArgument(f"Config: {field} = {value} is not one of {names}")
        return value
    name = str(value).lower()
    if field == "dtype":
        name = _DTYPE_ALIASES.get(name, name)
    if field == "kv_format" and name in ("f16", "bf16", "f32"):
        name = "plain"
    if name not in names:
        raise InvalidArgument(f"Config: {field} = {value!r} is not one of {names}")
    return names.index(name)


class Config:
    """A context's configuration: ``kvr_config`` as keyword arguments.

    Every argument left out takes the C library's default (``kvr_config_init``;
    docs/api.md has the table); ``n_layers``, ``n_qo_heads`` and ``n_kv_heads``
    have none. Enums are names (``mode="freekv"``, ``dtype="bf16"`` or a torch
    or numpy dtype, ``kv_format="k8v4"``). ``threads=None`` is one worker per
    core minus one, ``numa_node=None`` the GPU's node or the caller's,
    ``sink_tokens=None`` and ``window_tokens=None`` (the defaults) each
    min(512, budget_tokens / 4) in whole pages. A :class:`Context`'s
    ``config`` holds what these resolved to.
    ``dense_layers`` is a set of layer indices. ``thread_pool`` shares a
    :class:`ThreadPool`'s workers. The configuration is validated on creation:
    a field outside its rule raises :class:`InvalidArgument` (a ``ValueError``)
    naming it.
    """

    _FIELDS = tuple(_kvrecall.config_defaults().keys())

    def __init__(
        self,
        *,
        n_layers: int = 0,
        n_qo_heads: int = 0,
        n_kv_heads: int = 0,
        head_dim: Optional[int] = None,
        dtype: Any = None,
        page_tokens: Optional[int] = None,
        budget_tokens: Optional[int] = None,
        sink_tokens: Optional[int] = None,
        window_tokens: Optional[int] = None,
        tau: Optional[float] = None,
        mode: Union[str, int, None] = None,
        backend: Union[str, int, None] = None,
        recall_buffers: Optional[int] = None,
        dense_layers: Optional[Iterable[int]] = None,
        max_sequences: Optional[int] = None,
        max_batch: Optional[int] = None,
        pool_bytes: Optional[int] = None,
        device_bytes: Optional[int] = None,
        numa_node: Optional[int] = None,
        threads: Optional[int] = None,
        recall_chunk_pages: Optional[int] = None,
        log_level: Union[str, int, None] = None,
        recall: Union[str, int, None] = None,
        pool_layout: Union[str, int, None] = None,
        controller: Union[str, int, None] = None,
        kv_format: Union[str, int, None] = None,
        spill_queue_depth: Optional[int] = None,
        pool_ram_bytes: Optional[int] = None,
        spill_dir: Optional[str] = None,
        estimate: Optional[bool] = None,
        thread_pool: Optional[ThreadPool] = None,
    ) -> None:
        given = dict(locals())
        del given["self"]
        defaults = _kvrecall.config_defaults()
        for name in self._FIELDS:
            value = given.get(name)
            raw = defaults[name] if value is None else value
            object.__setattr__(self, name, self._pythonic(name, raw))
        object.__setattr__(self, "thread_pool", thread_pool)
        self.validate()

    @staticmethod
    def _pythonic(name: str, raw: Any) -> Any:
        if name in _ENUM_NAMES:
            return _ENUM_NAMES[name][_enum_value(name, raw)]
        if name == "dense_layers":
            return frozenset(int(layer) for layer in raw)
        if name == "estimate":
            return bool(raw)
        if name == "threads":
            return None if raw == _THREADS_AUTO else int(raw)
        if name in _TOKENS_FIELDS and raw == _TOKENS_AUTO:
            return None
        if name == "numa_node":
            return None if raw == _NUMA_AUTO else int(raw)
        if name == "tau":
            return float(raw)
        if name == "spill_dir":
            return str(raw)
        if isinstance(raw, bool) or not isinstance(raw, int):
            try:
                raw = raw.__index__()
            except AttributeError:
                raise TypeError(f"Config: {name} must be an int, got {type(raw).__name__}") from None
        return raw

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is immutable: use config.replace(field=value)")

    def _to_c(self) -> dict:
        out = {}
        for name in self._FIELDS:
            value = getattr(self, name)
            if name in _ENUM_NAMES:
                value = _ENUM_NAMES[name].index(value)
            elif name == "threads":
                value = _THREADS_AUTO if value is None else value
            elif name in _TOKENS_FIELDS:
                value = _TOKENS_AUTO if value is None else value
            elif name == "numa_node":
                value = _NUMA_AUTO if value is None else value
            elif name == "estimate":
                value = int(value)
            elif name == "dense_layers":
                value = sorted(value)
            out[name] = value
        if self.thread_pool is not None:
            out["threads"] = self.thread_pool.threads
        return out

    def validate(self) -> None:
        """Raise the error ``kvr_config_validate`` finds (naming the field), or return."""
        _kvrecall.config_validate(self._to_c())

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed (validated)."""
        fields = self.to_dict()
        fields["thread_pool"] = self.thread_pool
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"Config: unknown field(s) {sorted(unknown)}")
        fields.update(changes)
        return Config(**fields)

    def to_dict(self) -> dict:
        """The fields as a dict of Python values (enums as names)."""
        return {name: getattr(self, name) for name in self._FIELDS}

    def device_bytes_needed(self) -> tuple:
        """(fixed, per_sequence) device bytes a context of this config needs."""
        return _kvrecall.device_bytes_needed(self._to_c())

    @classmethod
    def _from_c(cls, raw: Mapping[str, Any], thread_pool: Optional[ThreadPool] = None) -> "Config":
        self = cls.__new__(cls)
        for name in cls._FIELDS:
            object.__setattr__(self, name, cls._pythonic(name, raw[name]))
        object.__setattr__(self, "thread_pool", thread_pool)
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        defaults = Config._from_c(_kvrecall.config_defaults()).to_dict()
        changed = {k: v for k, v in self.to_dict().items() if v != defaults[k] or k.startswith("n_")}
        body = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        return f"kvrecall.Config({body})"


def device_bytes_needed(config: Config) -> tuple:
    """(fixed, per_sequence) device bytes a context of ``config`` needs."""
    return config.device_bytes_needed()


SeqLike = Union["Sequence", int]


class Sequence:
    """One request's KV cache in a :class:`Context`: per layer its tokens' keys
    and values. Anywhere a sequence id is expected a Sequence works too
    (``__index__``). It lives until :meth:`free` (or the ``with`` block that
    holds it ends, or the context closes): it is not freed by the garbage
    collector, since its id may be shared with C code."""

    __slots__ = ("context", "id")

    def __init__(self, context: "Context", seq_id: int) -> None:
        self.context = context
        self.id = seq_id

    def __index__(self) -> int:
        return self.id

    __int__ = __index__

    def length(self, layer: int = 0) -> int:
        """Tokens stored in ``layer``."""
        return self.context._c.seq_length(self.id, layer)

    def __len__(self) -> int:
        return self.length(0)

    def fork(self) -> "Sequence":
        """A new sequence holding the same tokens (full pages shared, copied on write)."""
        return Sequence(self.context, self.context._c.seq_fork(self.id))

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens of every layer."""
        self.context._c.seq_truncate(self.id, n_tokens)

    def free(self) -> None:
        """Free the sequence and the pages only it holds."""
        self.context._c.seq_free(self.id)

    def stats(self) -> dict:
        """This sequence's counters since its creation."""
        return self.context._c.stats(self.id)

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.context.closed:
            self.free()

    def __repr__(self) -> str:
        return f"kvrecall.Sequence(id={self.id})"


class Context:
    """A kvrecall context: the page pool, the device page cache and the
    controller thread of one model shape.

    ``Context(config)`` or ``Context(n_layers=..., n_qo_heads=..., ...)`` (the
    keywords of :class:`Config`). Close it with :meth:`close` or a ``with``
    block; calls on a closed context raise :class:`InvalidArgument`.

    Tensor layouts (the C API's): prefill ``k, v`` are ``[n_tokens, n_kv_heads,
    head_dim]``, prefill attention's ``q, out`` ``[n_tokens, n_qo_heads,
    head_dim]``, a decode step's ``q, out`` ``[batch, n_qo_heads, head_dim]``
    and ``k, v`` ``[batch, n_kv_heads, head_dim]``; any C-contiguous shape of as
    many elements ending in ``head_dim`` (or heads x head_dim) is accepted. The
    element type is the config's dtype (a numpy ``uint16`` array stands for
    bfloat16). Prefill takes host memory; a decode step takes host memory on the
    cpu backend and CUDA memory on the cuda one, where it runs on torch's current
    stream unless ``stream=`` says otherwise.
    """

    def __init__(self, config: Optional[Config] = None, /, **fields: Any) -> None:
        if config is None:
            config = Config(**fields)
        elif fields:
            config = config.replace(**fields)
        elif not isinstance(config, Config):
            raise TypeError("Context(config): config must be a kvrecall.Config")
        self._c = _kvrecall.Context(config._to_c(), config.thread_pool)
        self._thread_pool = config.thread_pool
        self.config: Config = Config._from_c(self._c.config(), config.thread_pool)
        """The resolved configuration (automatic fields replaced by what was chosen)."""

    # -- life cycle --------------------------------------------------------
    def close(self) -> None:
        """Cancel an open decode step and free everything. Idempotent."""
        self._c.close()

    @property
    def closed(self) -> bool:
        return self._c.closed

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- sequences ---------------------------------------------------------
    def sequence(self) -> Sequence:
        """Create an empty sequence."""
        return Sequence(self, self._c.seq_create())

    def prefill(self, seq: SeqLike, layer: int, k: Any, v: Any, position: Optional[int] = None) -> None:
        """Store a prompt's keys and values of one layer, ``[n_tokens, n_kv_heads,
        head_dim]`` (keys rotated), at ``position`` (default: the layer's length,
        which is the only position allowed). Blocks until stored."""
        self._c.prefill(seq, layer, k, v, position)

    def prefill_attention(self, seq: SeqLike, layer: int, q: Any, out: Any = None,
                          position: Optional[int] = None) -> Any:
        """Causal attention of ``q`` ``[n_tokens, n_qo_heads, head_dim]`` over the
        layer's stored tokens, for queries at ``position``.. (default: the last
        n_tokens stored). Writes and returns ``out`` (allocated like ``q`` when
        None)."""
        return self._c.prefill_attention(seq, layer, q, out, position)

    # -- decode ------------------------------------------------------------
    def decode_step(self, seqs: Iterable[SeqLike], positions: Optional[_Seq[int]] = None) -> DecodeStep:
        """Begin a decode step for a batch (``positions`` default to each
        sequence's length). Returns the open ``DecodeStep``: call
        ``step.layer(layer, q, k, v, out)`` for every layer, then leave its
        ``with`` block (or call ``step.end()``)."""
        return self._c.decode_begin(seqs if isinstance(seqs, (list, tuple)) else list(seqs), positions)

    decode_begin = decode_step

    def decode_reserve(self, batch: int, max_tokens: int) -> None:
        """Size the step buffers a CUDA graph capture needs (cuda backend)."""
        self._c.decode_reserve(batch, max_tokens)

    # -- counters, errors, traces -------------------------------------------
    def stats(self, seq: Optional[SeqLike] = None) -> dict:
        """Counters (``kvr_stats``) of the context, or of one sequence."""
        return self._c.stats(seq)

    def head_corrections(self, seq: Optional[SeqLike] = None) -> list:
        """freekv corrections per KV head, summed over layers (all live sequences or one)."""
        return self._c.head_corrections(seq)

    def async_error(self) -> Optional[Error]:
        """The first failure on the context's own threads since the last call
        (an :class:`Error`, not raised), or None."""
        return self._c.async_error()

    def binding_stats(self) -> dict:
        """Decode layer calls and the nanoseconds spent inside ``kvr_decode_layer``
        as the binding measures them (``layer_calls``, ``layer_call_ns``): a
        call's time from Python beyond that is the binding's own cost."""
        return self._c.binding_stats()

    def last_error(self) -> str:
        """The message of the context's most recent failed call, or ""."""
        return self._c.last_error()

    def trace_start(self, max_spans: int = 1 << 20) -> None:
        """Record spans of the engine's thread, the controller and the streams."""
        self._c.trace_start(max_spans)

    def trace_write(self, path: str) -> None:
        """Stop recording and write a Chrome trace-event JSON (open it in Perfetto)."""
        self._c.trace_write(path)

    def __repr__(self) -> str:
        if self.closed:
            return "kvrecall.Context(closed)"
        c = self.config
        return (f"kvrecall.Context(backend={c.backend!r}, mode={c.mode!r}, layers={c.n_layers}, "
                f"heads={c.n_qo_heads}/{c.n_kv_heads}, head_dim={c.head_dim}, dtype={c.dtype!r}, "
                f"budget={c.budget_tokens})")
