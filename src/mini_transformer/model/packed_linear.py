"""Prepacked linear weights on the CPU: every nn.Linear of the model runs through oneDNN's matmul with its
weight reordered once into oneDNN's blocked layout, instead of `aten::mm` on the row-major weight.

A serving step multiplies a few to a few dozen rows (one per running sequence) by every weight matrix.
At that size a GEMM's time goes to packing: `aten::mm` copies panels of the weight into the layout its
micro-kernel reads on every call, although the weight never changes. oneDNN lets that copy be made
once (`mkldnn._reorder_linear_weight`), and its matmul (`mkldnn._linear_pointwise`) then reads the
packed weight directly. vLLM's CPU backend and inductor's weight freezing do the same.

    pack_linears(model)     # in place: each nn.Linear becomes a PackedLinear with the same parameters

A PackedLinear is still an nn.Linear (same weight, bias, state_dict; quantize() and the rest see a
Linear). It packs lazily on its first CPU fp32 inference call, and again whenever its weight tensor
changes (a load, `.to()`, a new Parameter). Training (autograd), torch.compile (inductor lowers the
plain matmul its own way) and any other device or dtype take `F.linear`, so the model stays one model.
The numbers differ from `aten::mm` by float rounding only (another summation order); a row's result does
not depend on the other rows in the batch.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F

PACK_ROWS = 64  # the row count oneDNN chooses its weight layout for: a full decode batch


@cache
def packing_available() -> bool:
    """Whether this PyTorch build has oneDNN's linear ops (tried once on a tiny input)."""
    try:
        w = torch.ones(8, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16), packed, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedLinear(nn.Linear):
    """nn.Linear whose CPU fp32 inference reads a oneDNN-packed copy of its weight."""

    _packed: torch.Tensor | None = None  # oneDNN's opaque tensor: made on first use, never saved or copied
    _packed_from: tuple | None = None  # what the weight was when packed

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """A PackedLinear sharing `linear`'s parameters (no copy until it first packs)."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def __getstate__(self):  # deepcopy/pickle: a oneDNN tensor has no storage to copy; a copy packs anew
        return {**super().__getstate__(), "_packed": None, "_packed_from": None}

    def _packs(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (w.device.type == "cpu" and w.dtype == torch.float32 and x.dtype == torch.float32
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
                and not torch.compiler.is_compiling())

    def packed_weight(self) -> torch.Tensor:
        """The oneDNN-packed weight, made again if the weight tensor changed since it was packed."""
        w = self.weight
        key = (w.data_ptr(), w.shape, None if w.is_inference() else w._version)  # in-place writes bump _version
        if self._packed_from != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
            self._packed_from = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packs(x):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        rows = x.reshape(-1, self.in_features)  # (R, in): oneDNN's linear takes a matrix
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight(), bias, "none", [], "")  # (R, out)
        return y.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every plain nn.Linear of `model` in place by a PackedLinear over the same parameters (a
    no-op where oneDNN is missing). Returns the same model."""
    if not packing_available():
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:  # quantized, LoRA or already packed layers stay as they are
                setattr(module, name, PackedLinear.from_linear(child))
    return model
