"""attn_implementation="flashgen" in a small randomly initialised Llama (no download)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.integrations.transformers import register  # noqa: E402


def _llama(attn: str, device: str, dtype: torch.dtype, size: dict) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        **size,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _compare(device: str, dtype: torch.dtype, size: dict, seq: int) -> None:
    register()
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = _llama("sdpa", device, torch.float64 if device == "cpu" else torch.float32, size)
        truth = ref(ids).logits.double()
        ours = _llama("flashgen", device, dtype, size)(ids).logits.double()
        sdpa = _llama("sdpa", device, dtype, size)(ids).logits.double()
    # flashgen must land as close to the high-precision logits as SDPA in the same dtype.
    err, sdpa_err = (ours - truth).abs().max().item(), (sdpa - truth).abs().max().item()
    assert err <= 4 * sdpa_err + 1e-5, (err, sdpa_err)


@pytest.mark.interpreter
def test_tiny_llama_on_the_interpreter() -> None:
    size = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    _compare("cpu", torch.float32, size, seq=12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_llama_on_the_gpu(dtype: torch.dtype) -> None:
    size = {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    _compare("cuda", dtype, size, seq=200)


@pytest.mark.interpreter
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_runs_the_decode_family(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy `generate()` gives sdpa's tokens, and every new token's attention went through
    `attention_with_kvcache` (2 layers x 3 steps after the prompt). A static cache hands over
    all its slots; the valid length comes from the mask."""
    register()
    import flashgen.integrations.transformers as integration

    size = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 1}
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    calls: list[tuple[int, ...]] = []
    real = integration.flashgen.attention_with_kvcache

    def counted(q: torch.Tensor, k: torch.Tensor, *args: object, **kw: object) -> object:
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, *args, **kw)

    masks: list[tuple[int, ...]] = []
    real_step = integration._decode_step

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             options: dict) -> torch.Tensor:
        masks.append(tuple(mask.shape))
        return real_step(q, k, v, mask, options)

    monkeypatch.setattr(integration.flashgen, "attention_with_kvcache", counted)
    monkeypatch.setattr(integration, "_decode_step", step)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        tokens = {attn: _llama(attn, "cpu", torch.float32, size).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
            **extra) for attn in ("sdpa", "flashgen")}
    assert torch.equal(tokens["sdpa"], tokens["flashgen"]), calls
    assert len(calls) == 2 * 3 and all(nq == 1 for nq, _ in calls), calls
    if cache == "static":
        # Every slot of the cache (the last token is never cached), not only the valid keys,
        # and a mask of the cache's length every step: `generate()` makes it outside the
        # compiled forward, whose input shapes must not change from token to token.
        assert all(nk == 6 + 4 - 1 for _, nk in calls), calls
        # (The last step fills the cache: its all-ones mask is None, as flash-attention's.)
        assert len(masks) == len(calls) - 2 and set(masks) == {(2, 6 + 4 - 1)}, masks
    else:
        assert masks == []  # an unpadded dynamic cache has no mask


@pytest.mark.interpreter
def test_compiled_static_cache_generate_has_no_graph_break() -> None:
    """A static-cache `generate()` compiles the model's forward (on CUDA; forced here on the
    CPU). A decode step reads the mask on the device only (left padding through
    `cache_leftpad`), so the compiled forward has no graph break; a host read of the mask
    inside the layer loop made dynamo run the model eagerly and recompile it every step.
    Tokens equal eager sdpa's, on a left-padded batch too."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    register()
    size = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 1}
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is two tokens shorter, padded on the left
    compile_config = CompileConfig(fullgraph=False, backend="eager", mode=None)
    compile_config._compile_all_devices = True
    options = {"attention_mask": mask, "max_new_tokens": 6, "min_new_tokens": 6,
               "do_sample": False, "cache_implementation": "static", "pad_token_id": 0}
    with torch.no_grad():
        want = _llama("sdpa", "cpu", torch.float32, size).generate(
            ids, disable_compile=True, **options)
        torch._dynamo.reset()
        counters.clear()
        got = _llama("flashgen", "cpu", torch.float32, size).generate(
            ids, compile_config=compile_config, **options)
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(want, got)


@pytest.mark.interpreter
@pytest.mark.parametrize("is_causal", [None, False])
@pytest.mark.parametrize("compiling", [False, True])
def test_decode_step_matches_the_padded_path(is_causal: bool | None, compiling: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step with a 2-D mask reads its runs on the device (left padding, and the 0s
    a static cache's mask is padded with) and gives what unpadding to packed sequences
    gives, with the call's is_causal over the module's, compiled or not."""
    import flashgen.integrations.transformers as integration

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, 16, generator=gen)
    k, v = (torch.randn(2, 1, 12, 16, generator=gen) for _ in range(2))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    module = torch.nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    causal = True if is_causal is None else is_causal
    options = {"causal": causal, "scale": None, "window": None, "softcap": None, "sinks": None}
    # A static cache of 14 slots, 12 seen: the mask padded with 0s to the cache's length.
    k_static, v_static = (torch.cat([t, torch.randn(2, 1, 2, 16, generator=gen)], 2)
                          for t in (k, v))
    static_mask = torch.nn.functional.pad(mask, (0, 2))
    want = integration._padded(q, k, v, mask, options)
    monkeypatch.setattr(integration.torch.compiler, "is_compiling", lambda: compiling)
    for keys, values, m in ((k, v, mask), (k_static, v_static, static_mask)):
        got, _ = integration.flashgen_attention_forward(module, q, keys, values, m,
                                                        is_causal=is_causal)
        assert (got - want).abs().max().item() < 1e-5


def _generate(attn: str, ids: torch.Tensor, mask: torch.Tensor, **options: object
              ) -> tuple[torch.Tensor, torch.Tensor]:
    size = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    with torch.no_grad():
        out = _llama(attn, "cpu", torch.float32, size).generate(
            ids, attention_mask=mask, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True, **options)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.interpreter
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_a_hole_in_the_mask(cache: str) -> None:
    """A mask with a hole (a token masked inside the prompt) cannot be told as one run of keys
    per row: eager decode steps check for that on the host and unpad instead, so every
    step's logits stay sdpa's (left padding in the other row)."""
    register()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, 3:5] = 0
    mask[1, :2] = 0
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    want, want_logits = _generate("sdpa", ids, mask, max_new_tokens=4, **extra)
    got, got_logits = _generate("flashgen", ids, mask, max_new_tokens=4, **extra)
    assert torch.equal(want, got)
    assert (want_logits - got_logits).abs().max().item() < 1e-4


@pytest.mark.interpreter
def test_right_padded_short_prompt_into_a_static_cache() -> None:
    """A prompt of at most 16 tokens, right-padded, into a static cache keeps
    flash-attention's mask (it is not padded to the cache as a decode step's is): the logits
    at real tokens are sdpa's."""
    from transformers import StaticCache

    register()
    size = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0
    logits = {}
    for attn in ("sdpa", "flashgen"):
        model = _llama(attn, "cpu", torch.float32, size)
        cache = StaticCache(config=model.config, max_cache_len=10)
        with torch.no_grad():
            logits[attn] = model(ids, attention_mask=mask, past_key_values=cache,
                                 use_cache=True).logits
    real = mask.bool()
    assert (logits["sdpa"] - logits["flashgen"])[real].abs().max().item() < 1e-4


@pytest.mark.interpreter
def test_short_decoder_training_step_through_cross_attention() -> None:
    """Cross-attention of a short decoder (at most 16 queries) against a padded encoder in
    training: the decode family has no gradient, so the step takes the dense path, every
    query real (the mask covers the keys), and the gradients are sdpa's."""
    register()
    config = {"vocab_size": 96, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
              "encoder_attention_heads": 2, "decoder_attention_heads": 2,
              "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 32,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
              "decoder_start_token_id": 1, "dropout": 0.0, "attention_dropout": 0.0,
              "activation_dropout": 0.0}
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (2, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids[1, 6:] = 0
    labels = torch.randint(3, 96, (2, 8), generator=gen)
    grads = {}
    for attn in ("sdpa", "flashgen"):
        torch.manual_seed(0)
        model = transformers.BartForConditionalGeneration(
            transformers.BartConfig(**config, attn_implementation=attn)).float().train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        cross = model.model.decoder.layers[0].encoder_attn
        grads[attn] = [p.grad for p in (cross.q_proj.weight, cross.k_proj.weight)]
    for want, got in zip(grads["sdpa"], grads["flashgen"], strict=True):
        assert got is not None
        assert (want - got).abs().max().item() <= 1e-4 * want.abs().max().item() + 1e-6


# ---- from a user audit: models and arguments the integration once got wrong silently --------


def _module(causal: bool = True) -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal = causal  # type: ignore[assignment]
    return module.eval()


@pytest.mark.interpreter
def test_models_without_flash_support_and_position_bias_are_refused() -> None:
    """T5 (relative position bias) and the like are marked `_supports_flash_attn = False`;
    under "flashgen" they ran with the bias dropped, logits wrong and no error."""
    from flashgen.integrations.transformers import flashgen_attention_forward

    register()
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                   num_heads=4, attn_implementation="flashgen")
    with pytest.raises(ValueError, match="T5ForConditionalGeneration does not support flash"):
        transformers.T5ForConditionalGeneration(config)
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="position_bias"):
        flashgen_attention_forward(_module(), q, q, q, None,
                                   position_bias=torch.zeros(1, 2, 5, 5))


@pytest.mark.interpreter
def test_a_value_head_dim_other_than_the_querys_runs_padded() -> None:
    """DeepSeek's MLA: v's head dim below q's and k's. It crashed (unpadded: a kernel
    check; padded batch: a bare reshape error); now as transformers' flash path: v padded,
    the output cut back, the scale the query's own."""
    from flashgen.integrations.transformers import flashgen_attention_forward

    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 4, 9, 8, generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    for am in (None, mask):
        out, _ = flashgen_attention_forward(_module(), q, k, v, am)
        assert out.shape == (2, 9, 4, 8)
        scores = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
        scores = scores.masked_fill(torch.ones(9, 9).triu(1).bool(), float("-inf"))
        if am is not None:
            scores = scores.masked_fill(~am.bool()[:, None, None, :], float("-inf"))
        want = (scores.softmax(-1) @ v.double()).transpose(1, 2)
        real = slice(None) if am is None else am.bool()
        assert (out.double() - want)[real].abs().max().item() < 1e-5


@pytest.mark.interpreter
def test_packed_keys_of_their_own_and_packs_that_begin_mid_document() -> None:
    """Continuous batching gives `cu_seq_lens_k` of its own (new tokens against cached ones):
    they were ignored and the keys cut as the queries. A pack whose first document began in
    an earlier pack (positions 3, 4, ..., then 0, ...) ran as one causal sequence."""
    from flashgen.integrations.transformers import _packed_lengths, flashgen_attention_forward
    from flashgen.tune import reference

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 16, generator=gen)  # one new token for each of three requests
    k, v = (torch.randn(1, 2, 12, 16, generator=gen) for _ in range(2))
    cu_q = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    out, _ = flashgen_attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu_q,
                                        cu_seq_lens_k=cu_k, max_length_q=1, max_length_k=5)
    pack = lambda t: t[0].transpose(0, 1)
    want, _ = reference.attention_varlen(pack(q), pack(k), pack(v), cu_q, cu_k, True,
                                         dtype=torch.float64)
    assert (out[0].double() - want).abs().max().item() < 1e-5
    positions = torch.tensor([[3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3]])
    x = torch.randn(1, 2, 11, 16)
    cu, cu_k2, longest, longest_k = _packed_lengths(x, x, None, {"position_ids": positions})
    assert cu.tolist() == [0, 4, 7, 11] and cu is cu_k2 and longest == longest_k == 4


@pytest.mark.interpreter
def test_output_attentions_is_said_to_give_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashgen.integrations.transformers as integration

    monkeypatch.setattr(integration, "_warned", set())  # said once a process
    q = torch.randn(1, 2, 5, 16)
    with pytest.warns(UserWarning, match="no attention weights"):
        integration.flashgen_attention_forward(_module(), q, q, q, None, output_attentions=True)
