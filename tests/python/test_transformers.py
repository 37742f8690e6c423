# SPDX-License-Identifier: MIT
"""kvrecall.transformers against transformers' own sdpa + DynamicCache, on tiny
random-weight models built from configs (no download): one per family, dense
equal to sdpa, sparse modes with the whole context in budget equal to dense,
freekv equal to the C library called directly, dtypes, crop, and every
unsupported case refused with a clear error."""
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvrecall  # noqa: E402
from kvrecall.transformers import KVRecallCache, _kvrecall_mask  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

torch.set_num_threads(2)
VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SHAPE, head_dim=32),
    "qwen2": lambda: Qwen2Config(**SHAPE),  # q/k/v projections with bias
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=32),  # q/k norms
    "mistral": lambda: MistralConfig(**SHAPE, head_dim=32),  # sliding_window 4096 by default
}
# small pages so that a 300-token prompt spans many of them
KV = dict(page_tokens=16, threads=1)


def make_model(family, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="sdpa")
    return model.to(dtype).eval()


def prompt(batch=2, length=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def generate(model, ids, cache=None, tokens=12):
    kwargs = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences, torch.stack(out.scores)


def reference(model, ids, tokens=12):
    model.set_attn_implementation("sdpa")
    return generate(model, ids, DynamicCache(config=model.config), tokens)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    return request.param, make_model(request.param)


def test_dense_equals_sdpa(family_model):
    family, model = family_model
    ids = prompt()
    ref_tokens, ref_scores = reference(model, ids)
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    tokens, scores = generate(model, ids, cache)
    assert torch.equal(tokens, ref_tokens), family
    torch.testing.assert_close(scores, ref_scores, atol=2e-4, rtol=1e-4)
    assert cache.get_seq_length() == ids.shape[1] + 11
    st = cache.stats()
    assert st["layer_decodes"] == 11 * 3 * 2 and st["failed_decodes"] == 0
    # torch keeps no keys or values for the cache
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    cache.close()


@pytest.mark.parametrize("mode", ["blocking", "speculative", "freekv"])
def test_sparse_modes_with_the_whole_context_in_budget_equal_dense(mode):
    model = make_model("qwen3")
    ids = prompt()
    dense_tokens, dense_scores = generate(model, ids, KVRecallCache.for_model(model, mode="dense", budget=512, **KV))
    cache = KVRecallCache.for_model(model, mode=mode, budget=512, **KV)
    tokens, scores = generate(model, ids, cache)
    assert torch.equal(tokens, dense_tokens)
    assert torch.equal(scores, dense_scores)


def record(cache):
    """Record the adapter's kvrecall calls: (kind, layer, q, k, v, past, out)."""
    calls = []
    prefill, decode = cache._prefill, cache._decode

    def rec_prefill(layer, q, k, v, past):
        out = prefill(layer, q, k, v, past)
        calls.append(("prefill", layer, q.clone(), k.clone(), v.clone(), past, out.clone()))
        return out

    def rec_decode(layer, n_layers, q, k, v):
        out = decode(layer, n_layers, q, k, v)
        calls.append(("decode", layer, q.clone(), k.clone(), v.clone(), None, out.clone()))
        return out

    cache._prefill, cache._decode = rec_prefill, rec_decode
    return calls


def test_freekv_small_budget_equals_the_c_library_called_directly():
    model = make_model("llama")
    ids = prompt(length=400)
    cache = KVRecallCache.for_model(model, mode="freekv", budget=128, sink_tokens=32, window_tokens=32, **KV)
    calls = record(cache)
    tokens, _ = generate(model, ids, cache, tokens=20)
    st = cache.stats()
    assert st["selections"] > 0 and st["checked_heads"] > 0
    assert st["dense_decodes"] < st["layer_decodes"]  # the sparse layers attended 128 of 400+ tokens
    n_layers = model.config.num_hidden_layers
    with kvrecall.Context(cache.context.config) as ctx:
        seqs = [ctx.sequence() for _ in range(ids.shape[0])]
        step = None
        for kind, layer, q, k, v, past, out in calls:
            if kind == "prefill":
                for b, s in enumerate(seqs):
                    ctx.prefill(s, layer, k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(), past)
                    mine = ctx.prefill_attention(s, layer, q[b].transpose(0, 1).contiguous(), None, past)
                    assert torch.equal(mine, out[b])
            else:
                if layer == 0:
                    step = ctx.decode_step(seqs)
                mine = step.layer(layer, q, k, v)
                assert torch.equal(mine.view_as(out), out), f"layer {layer}"
                if layer == n_layers - 1:
                    step.end()
        assert ctx.stats()["selections"] > 0  # (counted as the controller finishes them: not compared)
    # and it is not dense
    dense_tokens, _ = generate(model, ids, KVRecallCache.for_model(model, mode="dense", budget=128,
                                                                  sink_tokens=32, window_tokens=32, **KV), tokens=20)
    assert tokens.shape == dense_tokens.shape


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 6e-2), (torch.float16, 1e-2)])
def test_kv_dtype_follows_the_model(dtype, tol):
    model = make_model("llama", dtype=dtype)
    ids = prompt(batch=1, length=200)
    _, ref_scores = reference(model, ids, tokens=4)
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    _, scores = generate(model, ids, cache, tokens=4)
    assert cache.context.config.dtype == {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    # sink and window not given: a quarter of the budget each, from the library
    assert (cache.context.config.sink_tokens, cache.context.config.window_tokens) == (64, 64)
    # logits within the dtype's rounding (kvrecall accumulates in float32, torch's sdpa in its own way)
    finite = torch.isfinite(ref_scores)  # min_new_tokens masks the end-of-text token to -inf
    assert torch.equal(finite, torch.isfinite(scores))
    ref, got = ref_scores.float()[finite], scores.float()[finite]
    assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_crop_maps_to_truncate_and_decoding_goes_on():
    model = make_model("qwen2")
    ids = prompt(batch=1, length=120)
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    tokens, _ = generate(model, ids, cache, tokens=10)
    assert cache.get_seq_length() == 129
    cache.crop(-4)
    assert cache.get_seq_length() == 125
    assert all(s.length(layer) == 125 for s in cache.seqs for layer in range(3))
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)
    nxt = tokens[:, 125:126]
    with torch.no_grad():
        logits = model(nxt, cache=cache).logits[:, -1]
        model.set_attn_implementation("sdpa")
        ref = model(tokens[:, :126]).logits[:, -1]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


def test_past_key_values_name_and_reuse_after_reset():
    model = make_model("llama")
    ids = prompt(batch=1, length=64)
    ref_tokens, _ = reference(model, ids, tokens=5)
    cache = KVRecallCache.for_model(model, mode="freekv", budget=256, **KV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=5, min_new_tokens=5,
                                 do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref_tokens)
    cache.reset()
    assert cache.get_seq_length() == 0
    tokens, _ = generate(model, ids, cache, tokens=5)
    assert torch.equal(tokens, ref_tokens)


# -- what is not supported is refused, by name -------------------------------------------------

def test_beam_search_is_refused():
    model = make_model("llama")
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    with pytest.raises(kvrecall.NotSupported, match="beam"), torch.no_grad():
        model.generate(prompt(batch=1, length=32), cache=cache, num_beams=2, max_new_tokens=4, pad_token_id=0)


def test_padded_batch_is_refused():
    model = make_model("llama")
    ids = prompt(batch=2, length=32)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    with pytest.raises(kvrecall.NotSupported, match="padded"), torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, pad_token_id=0)


def test_sliding_window_past_its_window_is_refused():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**dict(SHAPE, head_dim=32), sliding_window=64)).eval()
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    with torch.no_grad():
        generate(model, prompt(batch=1, length=40), cache, tokens=4)  # within the window: fine
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    with pytest.raises(kvrecall.NotSupported, match="not plain causal|sliding"), torch.no_grad():
        generate(model, prompt(batch=1, length=100), cache, tokens=2)


def test_linear_attention_layers_and_non_causal_masks_are_refused():
    model = make_model("qwen2")
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(kvrecall.NotSupported, match="linear_attention"):
        KVRecallCache.for_model(model)
    with pytest.raises(kvrecall.NotSupported, match="not plain causal"):
        _kvrecall_mask(1, 4, 4, mask_function=lambda b, h, q, kv: True)


def test_gradients_and_dropout_are_refused():
    model = make_model("llama")
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    with pytest.raises(kvrecall.NotSupported, match="gradients"):
        model(prompt(batch=1, length=16), cache=cache)


def test_cache_and_attention_without_each_other_are_refused():
    model = make_model("llama")
    ids = prompt(batch=1, length=16)
    KVRecallCache.for_model(model)  # switches the model to "kvrecall"
    assert model.config._attn_implementation == "kvrecall"
    with pytest.raises(RuntimeError, match="needs a kvrecall.transformers.KVRecallCache"), torch.no_grad():
        model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=2, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    cache = KVRecallCache(3, 4, 2, 32, mode="dense", budget=256, **KV)
    with pytest.raises(RuntimeError, match="did not run through kvrecall"), torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=2, pad_token_id=0)


# -- the package with torch tensors ------------------------------------------------------------

def test_torch_tensor_misuse_raises_with_the_argument_named():
    with kvrecall.Context(n_layers=1, n_qo_heads=4, n_kv_heads=2, head_dim=32, dtype="f32", mode="dense",
                          page_tokens=16, budget_tokens=64, sink_tokens=16, window_tokens=16, threads=1) as ctx:
        seq = ctx.sequence()
        kv = torch.randn(20, 2, 32)
        ctx.prefill(seq, 0, kv, kv)
        q = torch.randn(1, 4, 32)
        with ctx.decode_step([seq]) as step:
            with pytest.raises(kvrecall.InvalidArgument, match="q: expected float32.*got float64"):
                step.layer(0, q.double(), kv[:1], kv[:1])
            with pytest.raises(kvrecall.InvalidArgument, match="q: expected float32.*got int32"):
                step.layer(0, q.to(torch.int32), kv[:1], kv[:1])
            with pytest.raises(kvrecall.InvalidArgument, match="k: the tensor is not contiguous"):
                step.layer(0, q, torch.randn(1, 32, 2).transpose(1, 2), kv[:1])
            with pytest.raises(kvrecall.InvalidArgument, match="out: the tensor requires grad"):
                step.layer(0, q, kv[:1], kv[:1], torch.zeros(1, 4, 32, requires_grad=True))
            with pytest.raises(kvrecall.InvalidArgument, match="device 'meta'"):
                step.layer(0, q.to("meta"), kv[:1], kv[:1])
            out = step.layer(0, q, kv[:1], kv[:1])
            assert isinstance(out, torch.Tensor) and out.shape == (1, 4, 32)
        if torch.cuda.is_available():
            with ctx.decode_step([seq]) as step, pytest.raises(kvrecall.InvalidArgument, match="a CUDA tensor"):
                step.layer(0, q.cuda(), kv[:1], kv[:1])


def cuda_backend_available():
    return torch.cuda.is_available() and kvrecall.system_info()["n_gpus"] > 0


@pytest.mark.skipif(not cuda_backend_available(), reason="no GPU usable by kvrecall's cuda backend")
def test_cuda_dense_equals_sdpa_and_freekv_runs():
    model = make_model("llama").cuda()
    ids = prompt().cuda()
    ref_tokens, ref_scores = reference(model, ids)
    cache = KVRecallCache.for_model(model, mode="dense", budget=256, **KV)
    tokens, scores = generate(model, ids, cache)
    assert cache.context.config.backend == "cuda"
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, atol=1e-3, rtol=1e-3)
    cache = KVRecallCache.for_model(model, mode="freekv", budget=128, sink_tokens=32, window_tokens=32, **KV)
    generate(model, ids, cache, tokens=20)
    assert cache.stats()["selections"] > 0
