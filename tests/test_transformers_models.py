"""attn_implementation="flashgen" on padded batches and the modifiers models use, in tiny
randomly initialised models (no download): Llama, Qwen2, Mistral (sliding window), Gemma 2
(softcap and sliding window) and gpt-oss (sinks and sliding window).

Bounds as elsewhere: flashgen's logits and gradients against the float64 eager model may be
4x the same-dtype eager model's error, plus float32 rounding of the largest value.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashgen  # noqa: E402
from flashgen.integrations.transformers import register  # noqa: E402

SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _gemma2() -> transformers.PretrainedConfig:
    return transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=4,
                                     attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                     query_pre_attn_scalar=16)


def _gpt_oss() -> transformers.PretrainedConfig:
    return transformers.GptOssConfig(**{**SMALL, "intermediate_size": 32}, head_dim=16,
                                     sliding_window=4, num_local_experts=2,
                                     num_experts_per_tok=1)


CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    "gemma2": _gemma2,
}
if hasattr(transformers, "GptOssConfig"):
    CONFIGS["gpt_oss"] = _gpt_oss


def _model(name: str, attn: str, dtype: torch.dtype) -> torch.nn.Module:
    config = CONFIGS[name]()
    torch.manual_seed(0)
    # gpt-oss's experts default to torch's grouped matmul, which has no float64.
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                          **extra)
    return model.to(dtype).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 11 and 6 tokens, left padded to 11."""
    ids = torch.randint(1, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :5] = 0
    ids[1, :5] = 0
    return ids, mask


def _within(ours: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    err = (ours.double() - truth).abs().max().item()
    eager_err = (eager.double() - truth).abs().max().item()
    bound = 4 * eager_err + torch.finfo(torch.float32).eps * max(1.0, truth.abs().max().item())
    assert err <= bound, f"{what}: error {err:.2e} over bound {bound:.2e}"


def _loss(logits: list[torch.Tensor], ids: list[torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy summed over every real token of every prompt, per token."""
    total = sum(torch.nn.functional.cross_entropy(x[:-1].double(), t[1:], reduction="sum")
                for x, t in zip(logits, ids, strict=True))
    return total / sum(t.numel() - 1 for t in ids)


def _step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at the real positions and the parameter gradients of `_loss`: the padded batch
    in one call, or (mask None) each prompt alone, unpadded."""
    real = mask if mask is not None else _batch()[1].to(ids.device)
    rows = [r[m.bool()] for r, m in zip(ids, real, strict=True)]
    if mask is not None:
        logits = model(ids, attention_mask=mask).logits
        per_row = [x[m.bool()] for x, m in zip(logits, mask, strict=True)]
    else:
        per_row = [model(r[None]).logits[0] for r in rows]
    _loss(per_row, rows).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return torch.cat(per_row).detach(), grads.detach()


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_batch_logits_and_grads(name: str) -> None:
    """The truth is each prompt alone, unpadded, in float64 (a padded float64 eager run puts
    NaN in pad rows, which its masked zeros carry into real rows)."""
    register()
    ids, mask = _batch()
    truth = _step(_model(name, "eager", torch.float64).train(), ids, None)
    eager = _step(_model(name, "eager", torch.float32).train(), ids, mask)
    ours = _step(_model(name, "flashgen", torch.float32).train(), ids, mask)
    _within(ours[0], eager[0], truth[0], f"{name} logits at non-pad positions")
    _within(ours[1], eager[1], truth[1], f"{name} parameter gradients")


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [n for n in ("llama", "mistral", "gemma2", "gpt_oss")
                                  if n in CONFIGS])
def test_batched_generate_matches_sdpa(name: str) -> None:
    """Greedy tokens of two prompts of different lengths (left padded), as sdpa's; Gemma 2's
    softcap and gpt-oss's sinks have no sdpa path in transformers, so eager is the baseline
    there. Each step runs the padded prefill, then one query per row against its cache."""
    register()
    ids, mask = _batch()
    baseline = "eager" if name in ("gemma2", "gpt_oss") else "sdpa"
    tokens = {}
    for attn in (baseline, "flashgen"):
        model = _model(name, attn, torch.float32)
        with torch.no_grad():
            tokens[attn] = model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                          do_sample=False, pad_token_id=0)
    assert torch.equal(tokens[baseline], tokens["flashgen"])


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [n for n in ("mistral", "gemma2", "gpt_oss") if n in CONFIGS])
def test_generate_steps_with_modifiers_run_the_decode_family(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One unpadded prompt of 9 tokens past a 4-token window: new tokens' steps go to
    `attention_with_kvcache` with the layer's modifiers (Gemma 2's softcap, gpt-oss's sinks;
    the sliding layers' caches reach it already cut to the window), and the greedy tokens
    are the eager model's."""
    register()
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    calls: list[dict] = []
    real = flashgen.attention_with_kvcache

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flashgen, "attention_with_kvcache", spy)
    tokens = {}
    for attn in ("eager", "flashgen"):
        model = _model(name, attn, torch.float32)
        with torch.no_grad():
            tokens[attn] = model.generate(ids, max_new_tokens=3, do_sample=False,
                                          pad_token_id=0)
    assert torch.equal(tokens["eager"], tokens["flashgen"])
    assert calls
    wanted = {"gemma2": "softcap", "gpt_oss": "sinks"}.get(name)
    assert wanted is None or any(c.get(wanted) is not None for c in calls), calls[:2]


@pytest.mark.interpreter
def test_packed_documents_by_position_ids() -> None:
    """Batch of one holding three documents (position ids restart at 0): logits equal those
    of each document run alone."""
    register()
    model = _model("llama", "flashgen", torch.float32)
    docs = [torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(n))
            for n in (5, 7, 3)]
    ids = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=positions).logits[0]
        alone = torch.cat([model(d).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)  # fp32: order of summation only


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_batch_on_the_gpu(name: str) -> None:
    """bf16 logits and gradients on the padded batch, against each prompt alone in float64
    (as on the CPU), bound by the bf16 eager model's error."""
    register()
    ids, mask = _batch()
    ids, mask = ids.cuda(), mask.cuda()
    truth = _step(_model(name, "eager", torch.float64).cuda().train(), ids, None)
    eager = _step(_model(name, "eager", torch.bfloat16).cuda().train(), ids, mask)
    ours = _step(_model(name, "flashgen", torch.bfloat16).cuda().train(), ids, mask)
    _within(ours[0], eager[0], truth[0], f"{name} bf16 logits at non-pad positions")
    _within(ours[1], eager[1], truth[1], f"{name} bf16 parameter gradients")
