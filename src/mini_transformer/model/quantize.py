"""Weight-only quantization: int8 per output channel, int4 per group; activations stay in float.

Decoding one token reads every weight once and does little arithmetic with each, so its speed is set by
how many bytes the weights take. Storing them in 8 or 4 bits reads a quarter or an eighth of fp32's bytes:

  int8  w[n, k] ~ s[n] * q[n, k],            q in [-127, 127], s[n] = max_k |w[n, k]| / 127  (symmetric)
  int4  w[n, k] ~ s[n, g] * q[n, k] + m[n, g], q in [0, 15], per group g of `group_size` inputs:
        m = the group's min, s = (max - min) / 15                                            (asymmetric)

Rounding moves each weight by at most half a step: |w - w_hat| <= s / 2. For an output
y[n] = sum_k x[k] w[n, k] the error is therefore at most sum_k |x[k]| * s[n, group(k)] / 2 (tests check it).

    quantize(model, "int8")               # every nn.Linear replaced in place; the model stays one TransformerLM
    quantize(model, "int4", group_size=64)
    model.save_pretrained(path); TransformerLM.from_pretrained(path)   # writes quantization.json; comes back quantized

How the matmul reads the small weights:
  * int8, inside a compiled decode step (a few rows): float_gemv.py's C++ GEMV loop (`mt_float::gemv_int8`,
    each weight widened to fp32 as it loads) where it has a SIMD path; elsewhere written as multiply-and-sum
    over the input dimension (`int8_rowwise`, the kernel's reference), which inductor fuses into ONE
    reduction kernel that reads the int8 bytes directly; otherwise (eager, prefill) dequantize, then F.linear;
  * int4, every row alike: the activations rounded to int8 per group and integer dot products with the
    packed codes (int4_gemv.py: a C++ kernel, AVX512-VNNI, AVX2 or portable, or its PyTorch reference) - never a
    dequantized weight in memory, and the same numbers eager, compiled, alone or in any batch;
  * `packed_kernels=True`: PyTorch's packed kernels (`aten._weight_int8pack_mm`, on the CPU
    `aten._weight_int4pack_mm_for_cpu`). They run on this project's CPU build but at batch 1 are far
    slower than the fp32 matmul and than our int4 kernel (docs/08b §3), so they are opt-in.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import choice, integer
from . import float_gemv
from .int4_gemv import int4_gemv_reference, kernel_available, kernel_groups_ok

MODES = ("int8", "int4")
FUSED_MAX_ROWS = 8  # a compiled step with at most this many rows (batch x tokens) uses the fused reduction


@cache
def _kernel_works(name: str, device_type: str) -> bool:
    """Whether aten's packed kernel `name` runs on this build and device (tried once on a tiny input)."""
    try:
        x = torch.randn(1, 64, device=device_type)
        if name == "int8":
            w = torch.ones(8, 64, dtype=torch.int8, device=device_type)
            torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, device=device_type))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 1)
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, torch.ones(2, 16, 2))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # (..., K) -> (M, K): the kernels take 2-D inputs


class Int8Linear(nn.Module):
    """y = (x @ q^T) * s + b with q (N, K) int8 and one scale per output channel s (N,)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.use_kernel = False  # a plain attribute, set by quantize(): a compiled step sees a constant
        # likewise whether a compiled decode step takes float_gemv.py's int8 loop: decided where CPU weights
        # arrive (from_linear, a state_dict load), so a layer made on another device never builds the C++
        self.gemv_kernel = False
        self.register_load_state_dict_post_hook(lambda module, _keys: module._pick_gemv())

    def _pick_gemv(self) -> None:
        self.gemv_kernel = self.weight.device.type == "cpu" and float_gemv.kernel_available(torch.int8)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach().float()  # (N, K)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device=w.device)
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
        layer.weight.copy_(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        layer.scales.copy_(scales)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        layer._pick_gemv()
        return layer

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales[:, None]  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]  # static under torch.compile
        if torch.compiler.is_compiling() and rows <= FUSED_MAX_ROWS:
            if self.gemv_kernel and x.dtype == self.scales.dtype == torch.float32 and x.device.type == "cpu":
                y = torch.ops.mt_float.gemv_int8(_flat(x), self.weight, self.scales, self.bias)  # bias included
                return y.view(*x.shape[:-1], self.out_features)
            y = int8_rowwise(_flat(x), self.weight, self.scales).view(*x.shape[:-1], self.out_features)
        elif self.use_kernel:
            y = torch.ops.aten._weight_int8pack_mm(_flat(x), self.weight, self.scales.to(x.dtype))  # (M, N)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def int8_rowwise(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float, q (N, K) int8, scales (N,) -> (M, N): sum_k x[m, k] q[n, k], times scales[n].
    Written as multiply-and-sum (not F.linear) so that inductor fuses the int8 -> float cast into the
    reduction and reads one byte per weight; eager, it would materialise (M, N, K) — small M only."""
    return (x[:, None, :] * q.to(x.dtype)).sum(dim=-1) * scales.to(x.dtype)  # (M, N, K) -> (M, N)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K/2) uint8: column 2j in the low half of byte j, 2j+1 in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: (N, K/2) uint8 -> (N, K) int32 in [0, 15]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(1).to(torch.int32)  # (N, K)


class Int4Linear(nn.Module):
    """Group-wise 4-bit weights: w[n, k] ~ q[n, k] * scale[g, n] + min[g, n], g = k // group_size.

    `weight` (N, K/2) uint8 holds two 4-bit values per byte (the portable form that is saved);
    `scales_and_zeros` (K/group_size, N, 2) holds, per group, the scale and the value of q = 8 —
    the layout aten's int4 kernel reads ((q - 8) * scale + zero). When that kernel runs here, its own
    packing of the weight is kept beside (not saved; rebuilt on load)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, device=None,
                 use_kernel: bool = False):
        super().__init__()
        assert in_features % group_size == 0 and group_size % 2 == 0
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.use_kernel = use_kernel
        n_groups = in_features // group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales_and_zeros", torch.zeros(n_groups, out_features, 2, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.register_buffer("kernel_weight", None, persistent=False)
        self.register_buffer("kernel_scales_and_zeros", None, persistent=False)
        # (N, G, 2): each group's scale and minimum side by side, for the int4 x int8 GEMV (int4_gemv.py:
        # a row's bytes in one stream); rebuilt by repack(), not saved
        self.register_buffer("gemv_scale_low", None, persistent=False)
        self.gemv_kernel = False  # a plain attribute (a compiled step sees a constant): the C++ kernel built
        self.register_load_state_dict_post_hook(lambda module, _keys: module.repack())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, use_kernel: bool = False) -> Int4Linear:
        w = linear.weight.detach().float()  # (N, K)
        N, K = w.shape
        layer = cls(K, N, linear.bias is not None, group_size, device=w.device, use_kernel=use_kernel)
        groups = w.view(N, K // group_size, group_size)  # (N, G, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, G)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).view(N, K)
        layer.weight.copy_(pack_nibbles(q))
        zero = low + 8 * scale  # the value of q = 8, the kernel's zero point
        layer.scales_and_zeros.copy_(torch.stack([scale, zero], dim=-1).transpose(0, 1))  # (G, N, 2)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        layer.repack()
        return layer

    def repack(self) -> None:
        """The GEMV's (N, G, 2) scales and group minimums; and, with use_kernel, aten's CPU kernel's
        own packing of the weight, if that kernel runs here. It takes groups of 32, 64, 128 or 256 and N
        divisible by 16: other N (GPT-2's 50257-word head) get zero rows up to the next multiple of 16,
        and the output is cut back to N."""
        scale, zero = self.scales_and_zeros.transpose(0, 1).unbind(-1)  # (N, G) each
        self.gemv_scale_low = torch.stack([scale, zero - 8 * scale], dim=-1)  # (N, G, 2)
        self.gemv_kernel = self.weight.device.type == "cpu" and kernel_groups_ok(self.group_size) \
            and kernel_available()
        self.kernel_weight = self.kernel_scales_and_zeros = None
        if not self.use_kernel or self.weight.device.type != "cpu" or self.group_size not in (32, 64, 128, 256) \
                or not _kernel_works("int4", "cpu"):
            return
        pad = -self.out_features % 16
        q = F.pad(unpack_nibbles(self.weight), (0, 0, 0, pad))  # (N + pad, K) int32
        self.kernel_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.kernel_scales_and_zeros = F.pad(self.scales_and_zeros, (0, 0, 0, pad))  # (G, N + pad, 2)

    def dequantize(self) -> torch.Tensor:
        q = unpack_nibbles(self.weight).float()  # (N, K)
        scale, zero = self.scales_and_zeros.transpose(0, 1).unbind(-1)  # (N, G) each
        q = q.view(self.out_features, -1, self.group_size)  # (N, G, group_size)
        return ((q - 8) * scale[..., None] + zero[..., None]).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is not None and x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                _flat(x), self.kernel_weight, self.group_size, self.kernel_scales_and_zeros.to(x.dtype))
            y = y[:, :self.out_features].reshape(*x.shape[:-1], self.out_features)  # (M, N + pad) -> (..., N)
        else:  # every row alike (eager, compiled, prefill, any batch): int8 activations x int4 weights
            y = self.gemv(_flat(x).float()).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) float32 -> (M, N): int4_gemv.py's arithmetic, by the C++ kernel where it built."""
        scale_low = self.gemv_scale_low.float()  # a no-op unless the model was cast after quantize()
        if self.gemv_kernel and x.device.type == "cpu":
            return torch.ops.mt_gemv.int4(x, self.weight, scale_low, self.group_size)
        return int4_gemv_reference(x, self.weight, scale_low, self.group_size)


def quantize(model: nn.Module, mode: str, group_size: int = 64, *, packed_kernels: bool = False) -> nn.Module:
    """Replace every nn.Linear of `model` in place by an Int8Linear or Int4Linear; returns the same model.
    `packed_kernels=True` runs eager matmuls through aten's packed kernels where they work.

    int4 leaves a layer whose input width is not a multiple of group_size in float (named in
    `model.quantization["skipped"]`). A tied head gets its own quantized copy; the embedding stays float."""
    choice("mode", mode, MODES)
    if integer("group_size", group_size) < 2 or group_size % 2:
        raise ValueError(f"group_size={group_size} must be an even integer >= 2")
    if getattr(model, "quantization", None):
        raise ValueError(f"the model is already quantized ({model.quantization['mode']})")
    skipped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full_name = f"{name}.{child_name}" if name else child_name
            if mode == "int8":
                layer = Int8Linear.from_linear(child)
                layer.use_kernel = packed_kernels and _kernel_works("int8", child.weight.device.type)
                setattr(module, child_name, layer)
            elif child.in_features % group_size == 0:
                setattr(module, child_name, Int4Linear.from_linear(child, group_size, use_kernel=packed_kernels))
            else:
                skipped.append(full_name)
    model.quantization = {"mode": mode, "group_size": group_size, "skipped": skipped}
    return model
