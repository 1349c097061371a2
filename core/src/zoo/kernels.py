"""The kernel seam: the named operations zoo's model primitives compute with, each with a reference
PyTorch implementation here, and the `Kernels` a run chose for them.

A primitive (`zoo.nn.rms_norm`, the LM loss, tensor-parallel linears, the attention core) calls
``kernels.active().call("rms_norm", x, weight, eps)``. Without a provider that is the reference
below; a provider is a distribution registering under the ``zoo.kernels`` entry-point group an
object with ``device`` (a torch device type) and ``select(options) -> Selection``: per operation an
implementation that returns ``NotImplemented`` for inputs it does not take (the reference then
runs), and optionally the elementwise compiler behind `Kernels.fuse`. zoo's own CPU kernels
(``zoo-cpu-kernels``: compiled elementwise passes, oneDNN products, C transposition, blocked
attention) are one such distribution; GPU packages found at run time stay in `zoo.backends`.

The choice is made once per run (`select`, by the Trainer, from ``train.cpu_*`` and
``ZOO_BACKENDS``) into a `Kernels` object; `Kernels.use` makes it the active one for the code the
run executes (a context variable, so two runs in one process, or a test and the run it checks, do
not see each other's choice). Autograd functions keep the `Kernels` their forward ran with for
their backward. Nothing is built or compiled by selecting: a provider builds its kernels at first
use.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

GROUP = "zoo.kernels"
Impl = Callable[..., Any]

# ------------------------------------------------------------------------------ the operations
# Each reference is the arithmetic an implementation must reproduce (within float32 rounding: a
# kernel may sum in another order), and what every device without a provider computes.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * (x / rms(x)), 1 / rms(x))`` with HF's numerics: float32 statistics, the
    normalised x rounded to x's dtype before the weight."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return rms_norm_again(x, weight, eps, rstd), rstd


def rms_norm_again(x: torch.Tensor, weight: torch.Tensor, eps: float, rstd: torch.Tensor) -> torch.Tensor:
    """`rms_norm`'s output recomputed from its input and statistics, bitwise the forward's."""
    return weight * (x.float() * rstd).to(x.dtype)


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `rms_norm` with respect to x and the weight."""
    xhat = x.float() * rstd
    gf = g.float()
    grad_w = (gf * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    gx = gf * weight.float()
    # rstd * (gx - xhat * mean(gx * xhat)): a row dot and multiply-add, no temporaries
    dot = torch.linalg.vecdot(gx, xhat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
    return torch.addcmul(gx, xhat, dot, value=-1).mul_(rstd).to(x.dtype), grad_w


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[gate | up]`` tensor."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """``[d gate | d up]`` of `swiglu`, written into one tensor (torch's silu_backward for the gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty_like(gate_up)
    d_gate, d_up = out.chunk(2, dim=-1)
    torch.mul(grad, F.silu(gate), out=d_up)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
    return out


def _up(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def broadcast_dims(full: torch.Tensor, small: torch.Tensor) -> tuple[int, ...]:
    """The dimensions ``small`` (same rank as ``full``) broadcasts along."""
    return tuple(i for i, (a, b) in enumerate(zip(full.shape, small.shape)) if b == 1 and a != 1)


def _reduce_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    dims = broadcast_dims(t, like)
    return (t.sum(dims, keepdim=True) if dims else t).to(like.dtype)


def modulated_ln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(LN(x) * (1 + scale) + shift`` rounded to ``dtype``, the rows' mean and 1/std)``: layer
    norm without affine weights in float32 (DiT's adaLN), by torch's layer-norm kernel."""
    xhat, mean, rstd = torch.native_layer_norm(_up(x), x.shape[-1:], None, None, eps)
    return torch.addcmul(_up(shift), xhat, 1 + _up(scale)).to(dtype), mean, rstd


def modulated_ln_again(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`modulated_ln`'s output again from its inputs (and statistics), bitwise the forward's."""
    return modulated_ln(x, shift, scale, eps, dtype)[0]


def modulated_ln_backward(g: torch.Tensor, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                          mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `modulated_ln` with respect to x, shift and scale (in their dtypes)."""
    xf, gf = _up(x), _up(g)
    gx = torch.ops.aten.native_layer_norm_backward(gf * (1 + _up(scale)), xf, x.shape[-1:], mean, rstd, None, None,
                                                   [True, False, False])[0]
    return gx.to(x.dtype), _reduce_to(gf, shift), _reduce_to(gf * ((xf - mean) * rstd), scale)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` (torch's ``addcmul``: one pass)."""
    return torch.addcmul(x, gate, y)


def gated_residual_backward(g: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, dims: tuple[int, ...]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `gated_residual` with respect to y and gate (summed over ``dims``, the dimensions
    gate broadcasts along), computed in float32."""
    gf = g.float()
    dgate = gf * y.float()
    return (gf * gate.float()).to(y.dtype), (dgate.sum(dims, keepdim=True) if dims else dgate).to(gate.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU (the activation's forward and its recomputation)."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g * GELU_tanh'(x)``."""
    return torch.ops.aten.gelu_backward(g, x, approximate="tanh")


def cross_entropy_grad(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` (N, V): the cross entropy against ``labels`` (float32), and its gradient
    times ``scale`` (N,) in the logits' dtype, ``(softmax - one_hot) * scale``, softmax in float32.
    ``softcap``: of the logits ``cap * tanh(logits / cap)`` (Gemma 2's), the gradient taken back
    through the cap."""
    if softcap is not None:
        th = torch.tanh(logits.float() / softcap)
        nll, d = cross_entropy_grad(th * softcap, labels, scale)
        return nll, (d * (1 - th * th)).to(logits.dtype)
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, labels[:, None]).squeeze(1)
    d = logp.exp_()  # the softmax; d loss / d logits once each row's label is taken off
    d[torch.arange(d.shape[0], device=d.device), labels] -= 1.0
    return nll, d.mul_(scale[:, None]).to(logits.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (autograd-aware)."""
    return F.linear(x, weight, bias)


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (2-D, for hand-written backward passes), into ``out`` if given, which may be wider
    than the operands (the product rounded to their dtype, then widened)."""
    if out is not None and out.dtype != a.dtype:
        return out.copy_(torch.mm(a, b))
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def mm_keeps_shapes(t: torch.Tensor) -> bool:
    """Whether `mm` of ``t`` builds and keeps a kernel for every new shape (oneDNN's: torch's bf16
    and fp16 CPU products), so a caller with ever-changing row counts pads them to a few shapes."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, offset: int,
              segment_ids: torch.Tensor | None, kv_segment_ids: torch.Tensor | None, window: int | None,
              softcap: float | None) -> Any:
    """The attention core; the reference is `zoo.nn.attention_ops.attend`'s own (torch's
    scaled_dot_product_attention), which it takes on this answer."""
    return NotImplemented


OPS: dict[str, Impl] = {f.__name__: f for f in (
    rms_norm, rms_norm_again, rms_norm_backward, swiglu, swiglu_backward, modulated_ln, modulated_ln_again,
    modulated_ln_backward, gated_residual, gated_residual_backward, gelu_tanh, gelu_tanh_backward,
    cross_entropy_grad, linear, mm, mm_keeps_shapes, attention)}


# ------------------------------------------------------------------------------- the choice


class Fuser(Protocol):
    def __call__(self, name: str, fn: Impl, eager: Impl, *args: Any) -> Any: ...


@dataclass(frozen=True)
class Selection:
    """What a provider chose for a run: implementations by operation name, the elementwise compiler
    (``fuse(name, fn, eager, *args)``) with the test of which tensors it takes, one line per
    choice for `zoo version` and the run's config.yaml, and notes to print once per run."""

    impls: Mapping[str, Impl] = field(default_factory=dict)
    fuse: Fuser | None = None
    fuses: Callable[[torch.Tensor], bool] | None = None
    lines: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # advice for the run's user (a precision this device computes slowly)


class Provider(Protocol):
    name: str
    device: str  # the torch device type its kernels compute on

    def select(self, options: Mapping[str, Any]) -> Selection: ...


class Kernels:
    """The operations' implementations for one run on one device type (`select`)."""

    def __init__(self, device: str = "cpu", selections: Mapping[str, Selection] | None = None) -> None:
        self.device = device
        self.selections = dict(selections or {})
        unknown = sorted({op for s in self.selections.values() for op in s.impls} - set(OPS))
        if unknown:
            raise ValueError(f"kernel provider(s) {sorted(self.selections)}: unknown operation(s) {unknown} "
                             f"(zoo.kernels.OPS has {sorted(OPS)})")
        self._impls: dict[str, list[Impl]] = {}
        for s in self.selections.values():
            for op, fn in s.impls.items():
                self._impls.setdefault(op, []).append(fn)
        fusers = [s for s in self.selections.values() if s.fuse is not None]
        self._fuser = fusers[0] if fusers else None

    def call(self, op: str, *args: Any) -> Any:
        """``op(*args)`` by the first implementation that takes these inputs, else the reference."""
        for fn in self._impls.get(op, ()):
            out = fn(*args)
            if out is not NotImplemented:
                return out
        return OPS[op](*args)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether elementwise work on ``x`` goes through the provider's compiler (`fuse`)."""
        s = self._fuser
        return s is not None and s.fuses is not None and s.fuses(x)

    def fuse(self, name: str, fn: Impl, eager: Impl, *args: Any) -> Any:
        """``fn(*args)`` compiled (the caller asked `fuses` first), else ``eager(*args)``, which
        computes the same values (``fn`` itself, or torch's own kernels for it)."""
        if self._fuser is not None and self._fuser.fuse is not None:
            return self._fuser.fuse(name, fn, eager, *args)
        return eager(*args)

    def report(self) -> list[str]:
        """One line per choice, for `zoo version` and the run's config.yaml."""
        lines = [line for s in self.selections.values() for line in s.lines]
        return lines or [f"kernels on {self.device}: zoo.kernels' PyTorch references (no provider for {self.device})"]

    def comment(self) -> str:
        """`report` as YAML comments (a run's config.yaml shows its kernels; loading ignores them)."""
        return "# kernels:\n" + "".join(f"#   {line}\n" for line in self.report())

    def notes(self) -> list[str]:
        return [n for s in self.selections.values() for n in s.notes]

    @contextlib.contextmanager
    def use(self) -> Iterator[Kernels]:
        """Make these the active kernels for the duration."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


REFERENCE = Kernels("any")
_ACTIVE: contextvars.ContextVar[Kernels] = contextvars.ContextVar("zoo_kernels", default=REFERENCE)


def active() -> Kernels:
    """The kernels of the run in progress (`Kernels.use`); the references outside one."""
    return _ACTIVE.get()


def providers() -> dict[str, Any]:
    """Every installed provider, by entry-point name; a provider that fails to load is skipped with a
    warning naming it (a broken optional package must not stop a run that can compute without it)."""
    import warnings

    try:
        from importlib.metadata import entry_points
    except ImportError:  # pragma: no cover - Python < 3.10
        from importlib_metadata import entry_points  # type: ignore[no-redef]

    out = {}
    for ep in entry_points(group=GROUP):
        try:
            out[ep.name] = ep.load()
        except Exception as e:  # noqa: BLE001 - any failure of a third party's import
            warnings.warn(f"kernel provider {ep.name!r} ({ep.value}) failed to load and is skipped: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
    return out


def select(device: str, options: Mapping[str, Any] | None = None) -> Kernels:
    """The kernels a run on ``device`` (a torch device string) computes with: each installed
    provider for its type, given ``options`` (the run's ``train.cpu_*`` settings)."""
    kind = torch.device(device).type
    chosen = {name: p.select(dict(options or {})) for name, p in sorted(providers().items()) if p.device == kind}
    return Kernels(kind, chosen)


def options(train: Any) -> dict[str, Any]:
    """A `zoo.config.TrainConfig`'s kernel settings, as providers read them."""
    return {"cpu_malloc": train.cpu_malloc, "cpu_gemm": train.cpu_gemm, "cpu_fused": train.cpu_fused,
            "precision": train.precision}


__all__ = ["GROUP", "OPS", "REFERENCE", "Kernels", "Provider", "Selection", "active", "options", "providers",
           "select"]
