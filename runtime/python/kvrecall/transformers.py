# SPDX-License-Identifier: MIT
"""kvrecall as a Hugging Face transformers backend: a cache and an attention function.

Any decoder-only model that uses transformers' standard attention interface
(Llama, Qwen2, Qwen3, Mistral, ...) decodes through kvrecall by swapping its
cache::

    from kvrecall.transformers import KVRecallCache
    cache = KVRecallCache.for_model(model, mode="freekv", budget=2048)
    out = model.generate(ids, cache=cache, max_new_tokens=256)

kvrecall owns the keys, values and the attention over them; the model's own
projections, RoPE, norms and MLP stay in torch. ``KVRecallCache.update`` only
notes the layer's new keys and values (torch keeps no KV cache); the attention
function registered as ``"kvrecall"`` then runs, for a prompt, ``kvr_prefill``
and (on the CPU) ``kvr_prefill_attention``, and for a decode step
``kvr_decode_layer``, in a step the first layer opens and the last closes.

Supported: batches of equal-length prompts, models in float32, float16 or
bfloat16 (the KV pages take the model's dtype), CPU tensors (the cpu backend)
and CUDA tensors (the cuda backend; the prompt's attention is then torch's
sdpa on the GPU and its keys and values are copied to the host pool), greedy
and sampled decoding, ``crop`` (truncation). Not supported, each refused with
:class:`kvrecall.NotSupported` naming it: beam search and other batch
reordering, padded batches, sliding-window attention past its window,
linear-attention or other non-full-attention layers, a mask that is not
causal, gradients.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "kvrecall.transformers needs transformers >= 5.0 (pip install 'kvrecall[transformers]')"
    ) from exc

from . import Config, Context, InvalidArgument, NotSupported

__all__ = ["KVRecallCache", "kvrecall_attention", "ATTN_IMPLEMENTATION", "SUPPORTED_TRANSFORMERS"]

ATTN_IMPLEMENTATION = "kvrecall"
"""The name the attention function is registered under."""

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
"""The transformers versions this adapter is written and tested for."""

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# The cache whose update ran last on this thread: transformers calls
# cache.update(k, v, layer) right before the same layer's attention, and does
# not hand the attention function the cache, so the cache notes itself here.
_active = threading.local()


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get else config


def _check_layer_types(config: Any) -> None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other and other != ["sliding_attention"]:
            raise NotSupported(
                f"kvrecall.transformers: layers of type {other}: kvrecall serves full-attention layers only "
                "(not linear-attention, chunked or hybrid layers)")


class KVRecallLayer(CacheLayerMixin):
    """One decoder layer's face of a :class:`KVRecallCache`. It stores nothing in
    torch: ``update`` hands the new keys and values to the attention function."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "KVRecallCache", layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.cache._note(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache._lengths[self.layer_idx]

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.cache._crop(tokens_to_remove)

    def reset(self) -> None:
        self.cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotSupported("KVRecallCache: beam search (reorder_cache) is not supported: use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotSupported("KVRecallCache: repeating the batch (batch_repeat_interleave) is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotSupported("KVRecallCache: selecting batch rows (batch_select_indices) is not supported")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class KVRecallCache(Cache):
    """A transformers ``Cache`` whose keys, values and attention live in kvrecall.

    Build it with :meth:`for_model` and pass it to ``generate(cache=...)`` (or
    ``past_key_values=`` where the installed transformers still uses that name)
    or to a model's forward. One cache serves one batch of sequences at a time;
    :meth:`reset` empties it for the next. The kvrecall context is created at the
    first prompt, when the batch, dtype and device are known, and closed by
    :meth:`close` (or when the cache is garbage-collected).
    """

    def __init__(self, n_layers: int, n_qo_heads: int, n_kv_heads: int, head_dim: int, *,
                 mode: str = "freekv", budget: int = 2048, sliding_window: Optional[int] = None,
                 **config: Any) -> None:
        super().__init__(layers=[KVRecallLayer(self, i) for i in range(n_layers)])
        if budget is not None:
            config.setdefault("budget_tokens", budget)
        self._fields = dict(n_layers=n_layers, n_qo_heads=n_qo_heads, n_kv_heads=n_kv_heads,
                            head_dim=head_dim, mode=mode, **config)
        # Validate now (the dtype and backend are placeholders until the first prompt).
        self._base = self._complete(dict(self._fields))
        self.sliding_window = sliding_window
        self.context: Optional[Context] = None
        self.seqs: list = []
        self._lengths = [0] * n_layers
        self._step = None
        self._awaiting = None
        self._device = None

    @classmethod
    def for_model(cls, model: Any, mode: str = "freekv", budget: int = 2048, **config: Any) -> "KVRecallCache":
        """A cache shaped for ``model`` (layers, heads, head size from its config).

        ``mode`` and ``budget`` (B, tokens attended per KV head) are kvrecall's;
        any other :class:`kvrecall.Config` field may be given (``sink_tokens``,
        ``window_tokens``, ``tau``, ``kv_format``, ``threads``, ...). Unless
        given, the sink and window are each a quarter of the budget, at most 512
        tokens, in whole pages (the library's default). The model's attention
        implementation is switched to ``"kvrecall"`` when it is not already
        (switch back with ``model.set_attn_implementation("sdpa")``)."""
        text = _text_config(model.config)
        _check_layer_types(text)
        n_qo = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_qo
        n_kv = getattr(text, "num_key_value_heads", None) or n_qo
        sliding = getattr(text, "sliding_window", None)
        if getattr(text, "use_sliding_window", True) is False:
            sliding = None
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return cls(text.num_hidden_layers, n_qo, n_kv, head_dim, mode=mode, budget=budget,
                   sliding_window=sliding, **config)

    # -- the configuration -------------------------------------------------
    def _complete(self, fields: dict) -> Config:
        fields.setdefault("backend", "cpu")
        return Config(**fields)

    def _open(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        if dtype not in _DTYPES:
            raise NotSupported(f"KVRecallCache: the model's dtype {dtype}: kvrecall takes float32, float16 or bfloat16")
        fields = dict(self._fields)
        fields["dtype"] = _DTYPES[dtype]
        fields["backend"] = "cuda" if device.type == "cuda" else "cpu"
        if device.type not in ("cpu", "cuda"):
            raise NotSupported(f"KVRecallCache: tensors on {device.type}: kvrecall runs on the CPU or CUDA")
        fields.setdefault("max_sequences", max(batch, 1))
        fields.setdefault("max_batch", max(batch, 1))
        if self.context is None or self.context.config.dtype != fields["dtype"] or \
                self.context.config.max_batch < batch or self._device != device:
            self.close()
            self.context = Context(self._complete(fields))
            self._device = device
        self.seqs = [self.context.sequence() for _ in range(batch)]

    # -- what transformers calls -------------------------------------------
    def _note(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        if self._awaiting is not None and self._awaiting != layer:
            pending = self._awaiting
            self._awaiting = None
            raise RuntimeError(
                f"KVRecallCache: layer {pending}'s attention did not run through kvrecall: load the model with "
                f"attn_implementation='{ATTN_IMPLEMENTATION}' or build the cache with KVRecallCache.for_model(model)")
        self._awaiting = layer
        _active.cache = self
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._lengths[layer_idx] if layer_idx < len(self._lengths) else 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return len(self.seqs) if self.seqs else -1

    @property
    def is_initialized(self) -> bool:
        return bool(self.seqs)

    def reset(self) -> None:
        """Free the batch's sequences (the context stays for the next batch)."""
        self._cancel_step()
        if self.context is not None and not self.context.closed:
            for s in self.seqs:
                s.free()
        self.seqs = []
        self._lengths = [0] * len(self._lengths)
        self._awaiting = None

    def crop(self, tokens_to_remove: int) -> None:
        self._crop(tokens_to_remove)

    def _crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"KVRecallCache.crop({tokens_to_remove}): pass a negative number of tokens to remove, as DynamicCache")
        if tokens_to_remove == 0 or not self.seqs:
            return
        keep = max(0, self._lengths[0] + tokens_to_remove)
        if keep == self._lengths[0] and all(n == keep for n in self._lengths):
            return
        self._cancel_step()
        for s in self.seqs:
            s.truncate(keep)
        self._lengths = [min(n, keep) for n in self._lengths]

    def close(self) -> None:
        """Close the kvrecall context (the cache can be used again: it reopens one)."""
        self._step = None
        if self.context is not None:
            self.context.close()
        self.context = None
        self.seqs = []
        self._lengths = [0] * len(self._lengths)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def stats(self) -> dict:
        """The kvrecall context's counters (``kvr_stats``), or {} before the first prompt."""
        return self.context.stats() if self.context is not None else {}

    def __repr__(self) -> str:
        return (f"KVRecallCache(layers={len(self.layers)}, mode={self._base.mode!r}, "
                f"budget={self._base.budget_tokens}, batch={len(self.seqs)}, length={self._lengths[0]})")

    # -- attention ---------------------------------------------------------
    def _cancel_step(self) -> None:
        step, self._step = self._step, None
        if step is not None and step.open:
            try:
                step.end()
            except Exception:
                pass  # a partly decoded step is taken back: the exception that left it is the news

    def _attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: Optional[float], sliding_window: Optional[int]) -> torch.Tensor:
        layer = module.layer_idx
        self._awaiting = None
        n_layers = len(self._lengths)
        batch, n_qo, q_len, head_dim = query.shape
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
            raise NotSupported("kvrecall attention computes no gradients: run under torch.no_grad()")
        if not getattr(module, "is_causal", True):
            raise NotSupported("kvrecall attention is causal: this module is not (is_causal=False)")
        past = self._lengths[layer]
        window = sliding_window if sliding_window is not None else self.sliding_window
        if window is not None and past + q_len > window:
            raise NotSupported(
                f"kvrecall attention: layer {layer} uses sliding-window attention (window {window}) and the "
                f"sequence reaches {past + q_len} tokens: kvrecall attends to every token (full attention)")
        if scaling is not None and not math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-6):
            # kvrecall scales by 1/sqrt(head_dim): fold the model's own scale into q
            query = query * (scaling * math.sqrt(head_dim))

        if layer == 0 and past == 0 and not self.seqs:
            self._open(batch, query.dtype, query.device)
        if not self.seqs:
            raise RuntimeError("KVRecallCache: a layer other than 0 came first: the cache is out of step "
                               "(call cache.reset())")
        if batch != len(self.seqs):
            raise NotSupported(f"KVRecallCache: batch {batch} but the cache holds {len(self.seqs)} sequences "
                               "(batch changes and beam search are not supported; call cache.reset())")
        if q_len == 1 and past > 0:
            out = self._decode(layer, n_layers, query, key, value)
        else:
            out = self._prefill(layer, query, key, value, past)
        self._lengths[layer] = past + q_len
        return out

    def _prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 past: int) -> torch.Tensor:
        if layer == 0:
            self._cancel_step()
        ctx = self.context
        batch, n_qo, q_len, head_dim = query.shape
        on_cuda = query.device.type == "cuda"
        out = torch.empty((batch, q_len, n_qo, head_dim), dtype=query.dtype, device=query.device)
        for b, seq in enumerate(self.seqs):
            k = key[b].transpose(0, 1)
            v = value[b].transpose(0, 1)
            if on_cuda:
                k, v = k.to("cpu"), v.to("cpu")
            ctx.prefill(seq, layer, k.contiguous(), v.contiguous(), past)
            if not on_cuda:
                ctx.prefill_attention(seq, layer, query[b].transpose(0, 1).contiguous(), out[b], past)
        if on_cuda:
            if past == 0:
                # the prompt's attention on the GPU by torch (keys and values still there)
                attn = torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, is_causal=q_len > 1, enable_gqa=key.shape[1] != n_qo)
                out.copy_(attn.transpose(1, 2))
            else:
                for b, seq in enumerate(self.seqs):
                    host_q = query[b].transpose(0, 1).contiguous().to("cpu")
                    out[b].copy_(ctx.prefill_attention(seq, layer, host_q, None, past))
        return out

    def _decode(self, layer: int, n_layers: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            self._cancel_step()
            self._step = self.context.decode_step(self.seqs)
        step = self._step
        if step is None:
            raise RuntimeError("KVRecallCache: a decode step reached layer "
                               f"{layer} without layer 0: the cache is out of step (call cache.reset())")
        batch, n_qo, _, head_dim = query.shape
        out = torch.empty((batch, 1, n_qo, head_dim), dtype=query.dtype, device=query.device)
        try:
            try:
                step.layer(layer, query, key, value, out)
            except InvalidArgument:
                # a model whose projections leave strided views: copy them (the
                # usual decode tensors are contiguous, and this costs nothing then)
                if all(t.is_contiguous() for t in (query, key, value)):
                    raise
                step.layer(layer, query.contiguous(), key.contiguous(), value.contiguous(), out)
        except BaseException:
            self._cancel_step()
            raise
        if layer == n_layers - 1:
            self._step = None
            step.end()
        return out


def kvrecall_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                       scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                       **kwargs: Any):
    """The attention function registered as ``"kvrecall"``: query ``[B, Hq, L, D]``
    and the layer's new key/value ``[B, Hkv, L, D]`` in, ``([B, L, Hq, D], None)`` out."""
    cache = getattr(_active, "cache", None)
    _active.cache = None  # not kept alive by this thread past its layer
    if cache is None or cache._awaiting != module.layer_idx:
        raise RuntimeError(
            f"attn_implementation '{ATTN_IMPLEMENTATION}' needs a kvrecall.transformers.KVRecallCache: pass "
            "cache=KVRecallCache.for_model(model) to generate() or to the model's forward (or switch back with "
            "model.set_attn_implementation('sdpa'))")
    if dropout:
        raise NotSupported("kvrecall attention has no dropout: call model.eval()")
    if attention_mask is not None:
        raise NotSupported("kvrecall attention: the mask is not the plain causal one (padded batches and "
                           "custom masks are not supported)")
    return cache._attend(module, query, key, value, scaling, sliding_window), None


def _kvrecall_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Any = causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
                   **kwargs: Any):
    """The mask function registered for ``"kvrecall"``: no mask (kvrecall's
    attention is causal by construction); a padded batch or a mask that is not
    causal (sliding, bidirectional, image-token overlays) is refused here,
    before any attention runs."""
    window = getattr(kwargs.get("config"), "sliding_window", None)
    if mask_function is not causal_mask_function and not (window is not None and kv_length <= window):
        # (a sliding window that the sequence has not outgrown is the causal mask)
        name = getattr(mask_function, "__name__", repr(mask_function))
        raise NotSupported(f"kvrecall attention: a mask that is not plain causal ({name}): kvrecall attends "
                           "causally to every token")
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise NotSupported("kvrecall attention: padded batches (an attention_mask with zeros) are not supported: "
                           "batch prompts of equal length")
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvrecall_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _kvrecall_mask)
