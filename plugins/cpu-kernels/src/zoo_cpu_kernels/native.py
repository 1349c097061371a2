"""zoo's C kernels (`native.c`), compiled at first use for the CPU the process runs on.

Neither torch nor its compiler has a fast transposition on a CPU: torch's strided copy of a
matrix into its transpose, and inductor's tiled one, take several times a plain copy. It matters
for a linear layer's weight gradient ``g.T @ x``: the reduction runs over tokens, the slow
dimension of both operands, and oneDNN's AMX GEMM reads its left operand along the reduction, so
it transposes one of them itself and the product takes longer than with a dense operand
(`zoo_cpu_kernels.gemm`). `transposed` does it in registers, 16 x 16 two-byte or 8 x 8 four-byte
tiles, converting bf16 <-> float32 in the same pass where asked (bitwise torch's conversions).

The same library has tanh-GELU and its derivative (one exponential, as `zoo_cpu_kernels.fused`'s
compiled kernels compute them, with fewer instructions) and attention's softmax with its scale
applied inside (`zoo_cpu_kernels.attention`), compiled where the CPU has AVX-512.

The library is built with the C compiler inductor uses (``$CC``, else ``cc``/``gcc``), ``-O3
-march=native`` and OpenMP when torch's own is OpenMP (the kernels then run on torch's OpenMP
runtime, already loaded: ``libgomp.so.1``), once per source, compiler and CPU into
``$ZOO_CACHE/native`` (default ``~/.cache/zoo``; a temporary directory where that is not writable).
Where it cannot be built or its self-test
fails, `available` is False with the reason, and every caller keeps torch's path. A run uses it
under ``train.cpu_fused=auto`` unless ``ZOO_BACKENDS=-native``, and only on a CPU with AMX (the
kind it was measured faster on: `zoo_cpu_kernels.gemm.has_amx`); nothing is built elsewhere.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from zoo import io

_KINDS = {  # (source dtype, output dtype) -> native.c's kind
    (torch.bfloat16, torch.bfloat16): 0, (torch.float16, torch.float16): 0, (torch.float32, torch.float32): 1,
    (torch.bfloat16, torch.float32): 2, (torch.float32, torch.bfloat16): 3,
}
_why = "not built yet"


def _cache_dir() -> Path:
    return Path(os.environ.get("ZOO_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "zoo") / "native"


def _cpu() -> str:
    """What code compiled with -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.split(":", 1)[0].strip() in ("model name", "flags", "Features")]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


def _build() -> tuple[ctypes.CDLL | None, str]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc, gcc or $CC)"
    source = (Path(__file__).with_name("native.c")).read_bytes()
    arch = "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"
    openmp = "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]
    flags = ["-O3", arch, "-std=gnu11", "-shared", "-fPIC"] + (["-fopenmp"] if openmp else [])
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc}: {e}"
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(), _cpu().encode()])).hexdigest()
    path = _cache_dir() / f"zoo-native-{key[:20]}.so"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    if not path.exists() and not writable:  # (a read-only home: this process's own copy)
        own = tempfile.mkdtemp(prefix="zoo-native-")
        atexit.register(shutil.rmtree, own, ignore_errors=True)
        path = Path(own) / path.name
    if not path.exists():
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".so")
            os.close(fd)
            src = path.parent / f".native-{key[:20]}-{os.getpid()}.c"
            src.write_bytes(source)
            try:
                done = subprocess.run([cc, *flags, str(src), "-o", tmp], capture_output=True, text=True, timeout=120)
            finally:
                src.unlink(missing_ok=True)
            if done.returncode:
                os.unlink(tmp)
                return None, f"{cc} failed: {' '.join(done.stderr.split())[:200]}"
            os.chmod(tmp, io.user_mode(directory=True))  # (mkstemp's 0600 -> what the umask gives)
            os.replace(tmp, path)  # whole or not at all, whoever else builds it at the same time
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {path.name}: {e}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"loading {path}: {e}"
    fn = lib.zoo_transpose
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_int]
    fn.restype = None
    lib.zoo_avx512.restype = ctypes.c_int
    lib.zoo_gelu_tanh.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.zoo_gelu_tanh.restype = None
    lib.zoo_gelu_tanh_backward.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.zoo_gelu_tanh_backward.restype = None
    for name, n in (("zoo_softmax_bf16", 2), ("zoo_softmax_backward_bf16", 3)):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * n + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    return lib, f"built with {Path(cc).name} {' '.join(flags)}{' (torch OpenMP runtime)' if openmp else ''}"


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _why
    lib, _why = _build()
    if lib is not None and not _self_test(lib):
        lib, _why = None, "its self-test gave other values than torch's transposition"
    return lib


def _self_test(lib: ctypes.CDLL) -> bool:
    """Every kind on a matrix with full tiles and edges, against torch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 53, generator=g)
    x[0, 3, 5] = float("nan")
    for (src, dst), kind in _KINDS.items():
        a = x.to(src)
        out = torch.empty(2, 53, 37, dtype=dst)
        _call(lib, kind, a, out)
        bits = torch.int16 if dst.itemsize == 2 else torch.int32  # (NaN compares unequal to itself)
        if not torch.equal(out.view(bits), a.transpose(1, 2).to(dst).contiguous().view(bits)):
            return False
    return True


def _call(lib: ctypes.CDLL, kind: int, a: torch.Tensor, out: torch.Tensor) -> None:
    a3, o3 = (a[None], out[None]) if a.dim() == 2 else (a, out)
    lib.zoo_transpose(kind, a3.data_ptr(), o3.data_ptr(), a3.shape[0], a3.shape[1], a3.shape[2], a3.stride(0),
                      a3.stride(1), o3.stride(0), o3.stride(1), torch.get_num_threads())


def describe() -> str:
    """What the library offers here (building it: a run calls this only where it will use it)."""
    lib = _library()
    if lib is None:
        return f"zoo's C kernels: unavailable ({_why})"
    vector = bool(lib.zoo_avx512())
    kernels = "transposition, GELU, softmax" if vector else "transposition (GELU and softmax need AVX-512)"
    used = "used (a CPU with AMX)" if "amx_tile" in _cpu().split() else "not used (no AMX: measured there only)"
    return f"zoo's C kernels ({kernels}): {_why}; {used}"


def available() -> bool:
    """Whether the library is built (building it at the first call)."""
    return _library() is not None


def status() -> str:
    """How the library was built, or why it was not (after the first use), for messages."""
    return _why


def _fits(a: torch.Tensor, out: torch.Tensor) -> bool:
    return (a.device.type == "cpu" and out.device.type == "cpu" and (a.dtype, out.dtype) in _KINDS
            and a.dim() == out.dim() and a.dim() in (2, 3) and a.shape[:-2] == out.shape[:-2]
            and a.shape[-2:] == out.shape[-2:][::-1] and a.stride(-1) == 1 and out.stride(-1) == 1)


def transpose_into(a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[..., j, i] = a[..., i, j]`` in ``out``'s dtype (2-D or batched 3-D; both with contiguous
    rows, any row and batch strides: ``out`` may be a view into a larger tensor), through the C
    kernel where it is available, else torch's copy (which autograd records, where it records)."""
    lib = _library()
    if lib is not None and a.numel() and _fits(a, out) and not (torch.is_grad_enabled() and a.requires_grad):
        _call(lib, _KINDS[(a.dtype, out.dtype)], a, out)
        return out
    return out.copy_(a.transpose(-1, -2))


def transposed(a: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a.transpose(-1, -2)`` as a new contiguous tensor in ``dtype`` (default: a's), for a 2-D or
    3-D ``a`` (no autograd)."""
    shape = (*a.shape[:-2], a.shape[-1], a.shape[-2])
    return transpose_into(a, torch.empty(shape, dtype=dtype or a.dtype, device=a.device))


def gelu_ok(*tensors: torch.Tensor) -> bool:
    """Whether `gelu_tanh` / `gelu_tanh_backward` take these tensors: contiguous CPU float32 or bf16
    tensors of one dtype, the library built with its AVX-512 GELU."""
    lib = _library()
    return (lib is not None and bool(lib.zoo_avx512())
            and all(t.device.type == "cpu" and t.dtype == tensors[0].dtype and t.is_contiguous()
                    and t.shape == tensors[0].shape for t in tensors)
            and tensors[0].dtype in (torch.float32, torch.bfloat16))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU of ``x`` (a new tensor, no autograd; `gelu_ok` first): native.c's AVX-512 kernel."""
    y = torch.empty_like(x)
    _library().zoo_gelu_tanh(int(x.dtype == torch.bfloat16), x.data_ptr(), y.data_ptr(), x.numel(),
                              torch.get_num_threads())
    return y


def gelu_tanh_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g * GELU_tanh'(x)`` (a new tensor, no autograd; `gelu_ok` first)."""
    out = torch.empty_like(g)
    _library().zoo_gelu_tanh_backward(int(x.dtype == torch.bfloat16), g.data_ptr(), x.data_ptr(), out.data_ptr(),
                                       x.numel(), torch.get_num_threads())
    return out


def softmax_ok(n: int) -> bool:
    """Whether `softmax` and `softmax_backward` take contiguous bf16 rows of ``n`` elements here."""
    lib = _library()
    return lib is not None and bool(lib.zoo_avx512()) and 0 < n <= 16384


def softmax(x: torch.Tensor, scale: float) -> torch.Tensor | None:
    """``softmax(scale * x, -1)`` of a contiguous bf16 CPU tensor (float32 inside, no autograd), or
    None where native.c's kernel does not take it (no AVX-512, rows over 16,384)."""
    lib = _library()
    if lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.is_contiguous() or not x.numel():
        return None
    y = torch.empty_like(x)
    n = x.shape[-1]
    return y if lib.zoo_softmax_bf16(x.data_ptr(), y.data_ptr(), x.numel() // n, n, scale,
                                     torch.get_num_threads()) else None


def softmax_backward(dp: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor | None:
    """``scale * p * (dp - (p * dp).sum(-1, keepdim=True))`` (the gradient of `softmax`'s input)
    for contiguous bf16 CPU tensors of one shape, or None where the kernel does not take them."""
    lib = _library()
    if (lib is None or dp.dtype != torch.bfloat16 or p.dtype != torch.bfloat16 or dp.shape != p.shape
            or dp.device.type != "cpu" or not (dp.is_contiguous() and p.is_contiguous()) or not p.numel()):
        return None
    ds = torch.empty_like(p)
    n = p.shape[-1]
    return ds if lib.zoo_softmax_backward_bf16(dp.data_ptr(), p.data_ptr(), ds.data_ptr(), p.numel() // n, n, scale,
                                               torch.get_num_threads()) else None
