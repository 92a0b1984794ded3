"""The operators registered with torch.library, so torch.compile traces through them, and the
autograd Function that eager calls take.

`<package>::attention_fwd` and `<package>::attention_bwd` (the namespace is spelt from the
package's name, `op_namespace`, so flashgen and any number of exported packages register
side by side in one process)
are opaque to the compiler: their fake implementations give output shapes, strides and
dtypes, and the real ones dispatch at run time like eager calls do. Autograd is registered
on the forward op, so gradients work in eager mode and under torch.compile alike. Only q, k,
v, the output and the log-sum-exp are saved for the backward: memory is O(N), never O(N^2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .dispatch import PACKAGE, Saved, default_dispatcher
from .kvcache import fresh_buffers
from .modifiers import Mods


def op_namespace(package: str) -> str:
    """The torch.library namespace of a package's ops. It takes no dots: "_" and "." are
    spelt "_u" and "_d", so that no two package names meet ("vend.pkg" and "vend_pkg" did,
    and one's ops then served the other's compiled calls)."""
    return package.replace("_", "_u").replace(".", "_d")


#: One namespace per package: two copies of this runtime must not register the same op.
NAMESPACE = op_namespace(PACKAGE)


#: What differentiating flashgen's gradients raises (it has the phrase of torch's own
#: `once_differentiable` error, "differentiate twice").
TWICE = (f"{PACKAGE} attention cannot differentiate twice: its backward kernels have no "
         "backward (a gradient penalty or a double backward needs another attention)")


class _Refused(torch.autograd.Function):
    """Copies of the first `count` tensors, tied in the graph to the rest (the inputs they
    depend on): differentiating them raises `TWICE`. Copies, not views, so that they can be
    changed in place as any gradient can (views out of a Function cannot)."""

    @staticmethod
    def forward(ctx: Any, count: int, *tensors: torch.Tensor) -> tuple:  # type: ignore[override]
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: object) -> tuple:  # type: ignore[override]
        raise RuntimeError(TWICE)


def differentiable_once(grads: Callable[..., tuple]) -> Callable[..., tuple]:
    """`grads` (an autograd backward whose ctx saved q, k, v first) run without recording;
    where autograd records the backward (create_graph=True), its gradients are tied to q,
    k, v, the sinks and the incoming gradients that require grad, so differentiating them
    raises. torch's `once_differentiable` ties them to nothing and raises only where an
    incoming gradient requires grad: a penalty on the gradient of `out.sum()` (constant
    incoming ones), taken by `autograd.grad(loss, [q, k, v])`, lost its term without an
    error."""

    @functools.wraps(grads)
    def wrapper(ctx: Any, *args: Any) -> tuple:
        with torch.no_grad():
            outputs = grads(ctx, *args)
        if not torch.is_grad_enabled():
            return outputs
        sources = [t for t in (*ctx.saved_tensors[:3], getattr(ctx, "sinks", None), *args)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        made = [t for t in outputs if t is not None]
        if not sources or not made:
            return outputs
        refused = iter(_Refused.apply(len(made), *made, *sources))
        return tuple(None if t is None else next(refused) for t in outputs)

    return wrapper


@torch.library.custom_op(f"{NAMESPACE}::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    variant: str,
    bwd_variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp). `variant` / `bwd_variant` are `Dispatcher.encode`'s text, or ""
    for tuned dispatch; the forward ignores `bwd_variant` and keeps it for its backward."""
    dispatcher = default_dispatcher()
    return dispatcher.forward(q, k, v, causal, scale, dispatcher.decode("fwd", variant))


@attention_fwd.register_fake
def _attention_fwd_fake(q: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Output like q and an fp32 (B, H, N) log-sum-exp: only q's shape decides them."""
    b, h, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::attention_bwd", mutates_args=())
def attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) recomputed block by block from the saved log-sum-exp."""
    dispatcher = default_dispatcher()
    return dispatcher.backward(grad_out, Saved(q, k, v, out, lse), causal, scale,
                               dispatcher.decode("bwd", variant))


@attention_bwd.register_fake
def _attention_bwd_fake(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients like the inputs they belong to."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, scale, _, bwd_variant = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.bwd_variant = causal, scale, bwd_variant
    # The log-sum-exp takes no gradient: without this autograd makes a zero tensor for it
    # in every backward (an allocation and a fill launch of host time).
    ctx.set_materialize_grads(False)


@differentiable_once  # the backward kernels have no backward: see `_once_only`
def _backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple:
    # The log-sum-exp is an auxiliary output: gradients do not flow back through it.
    if grad_out is None:  # grads are not materialized: nothing reached the output
        return None, None, None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.bwd_variant)
    return dq, dk, dv, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::attention_kvcache", mutates_args=())
def attention_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    variant: str,
    cache_leftpad: torch.Tensor | None = None,
    window: list[int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of the decode family, for torch.compile: traced, the kernel
    launch itself broke the graph (its float arguments became fp64 and the kernels failed to
    compile), which is what a static-cache `generate()` compiles. Eager calls skip the op.
    `window`, `softcap` and `sinks` as the public call checked them (sinks: the kernels'
    fp32 vector)."""
    dispatcher = default_dispatcher()
    mods = None
    if window is not None or softcap is not None or sinks is not None:
        mods = Mods(None if window is None else (window[0], window[1]), softcap, sinks)
    with fresh_buffers():  # no buffer kept past the call: CUDA graph trees refuse one
        return dispatcher.kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
                                  dispatcher.decode("decode", variant), mods, cache_leftpad)


@attention_kvcache.register_fake
def _attention_kvcache_fake(q: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Output like q (the launcher's `empty_like`) and an fp32 (B, Hq, Nq) log-sum-exp."""
    b, h, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)


class EagerAttention(torch.autograd.Function):
    """The same autograd as the registered op, for eager calls, without the op's dispatch
    layers: those cost a few hundred microseconds of host time per training step, which
    bounds small problems (on an H100, 1.2 ms of host per fwd+bwd call at B32 N512 against
    0.9 ms of GPU work). torch.compile still takes the op."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
        scale: float | None, variant: Any, bwd_variant: Any, dispatcher: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = dispatcher.forward(q, k, v, causal, scale, variant)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.bwd_variant, ctx.dispatcher = (causal, scale, bwd_variant,
                                                                  dispatcher)
        ctx.mark_non_differentiable(lse)
        # No zero tensor made for the log-sum-exp's gradient in every backward (see
        # `_setup_context`).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None,  # type: ignore[override]
                 ) -> tuple:
        return _once_only(_eager_grads, ctx, grad_out, grad_lse)


class ModifiedAttention(torch.autograd.Function):
    """Autograd for calls with modifiers (window, softcap, sinks) or packed sequences. The
    sinks are an input of their own so that their gradient reaches them; the kernels read
    `mods.sinks`, their fp32 copy. Eager only: under torch.compile the public calls that
    take modifiers run outside the graph (`torch.compiler.disable`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
        causal: bool, scale: float | None, mods: Any, variant: Any, bwd_variant: Any,
        dispatcher: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = dispatcher.forward(q, k, v, causal, scale, variant, mods)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.mods, ctx.bwd_variant, ctx.dispatcher = (
            causal, scale, mods, bwd_variant, dispatcher)
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        # For `differentiable_once` only: dsinks depends on them.
        ctx.sinks = sinks if sinks is not None and sinks.requires_grad else None
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # as EagerAttention
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None,  # type: ignore[override]
                 ) -> tuple:
        return _once_only(_modified_grads, ctx, grad_out, grad_lse)


def _eager_grads(ctx: Any, grad_out: torch.Tensor | None, _: object) -> tuple:
    """`EagerAttention`'s gradients (None where nothing reached the output)."""
    if grad_out is None:
        return None, None, None, None, None, None, None, None
    dq, dk, dv = ctx.dispatcher.backward(grad_out, Saved(*ctx.saved_tensors), ctx.causal,
                                         ctx.scale, ctx.bwd_variant)
    return dq, dk, dv, None, None, None, None, None


def _modified_grads(ctx: Any, grad_out: torch.Tensor | None, _: object) -> tuple:
    """`ModifiedAttention`'s gradients, dsinks in the sinks' dtype."""
    if grad_out is None:
        return (None,) * 10
    grads = ctx.dispatcher.backward(grad_out.contiguous(), Saved(*ctx.saved_tensors),
                                    ctx.causal, ctx.scale, ctx.bwd_variant, ctx.mods)
    dsinks = grads[3].to(ctx.sinks_dtype) if ctx.sinks_dtype is not None else None
    return grads[0], grads[1], grads[2], dsinks, None, None, None, None, None, None


#: Each gradient function as `differentiable_once` wraps it.
_ONCE = {fn: differentiable_once(fn) for fn in (_eager_grads, _modified_grads)}


def _once_only(grads: Any, ctx: Any, grad_out: torch.Tensor | None, grad_lse: object) -> tuple:
    """`grads(ctx, grad_out, grad_lse)`. The backward kernels have no backward of their own,
    so where autograd records one (create_graph=True: grad mode is on in the backward) the
    gradients come through `differentiable_once`: a second derivative (a gradient penalty) is
    then an error, never a silently dropped term. Otherwise they come straight: the wrapper
    costs 3-4 us of host time a step."""
    if torch.is_grad_enabled():
        return _ONCE[grads](ctx, grad_out, grad_lse)
    return grads(ctx, grad_out, grad_lse)


class EmptyAttention(torch.autograd.Function):
    """Attention where the batch, the queries or the keys number 0: no kernel runs. Each row
    sees no key, so its output is 0 and its log-sum-exp -inf, or the head's sink where there
    is one (the sink joins the denominator with no value); every gradient is 0."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(q, k, v, sinks)
        b, h, n, _ = q.shape
        if sinks is None:
            lse = torch.full((b, h, n), float("-inf"), device=q.device, dtype=torch.float32)
        else:
            lse = sinks.detach().float().view(1, h, 1).expand(b, h, n).contiguous()
        ctx.mark_non_differentiable(lse)
        return torch.zeros_like(q), lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None,  # type: ignore[override]
                 ) -> tuple:
        # Zeros whatever q, k, v and the incoming gradient are: their own derivative is 0, so
        # a double backward through them is exact, not refused.
        return tuple(None if t is None else torch.zeros_like(t) for t in ctx.saved_tensors)
