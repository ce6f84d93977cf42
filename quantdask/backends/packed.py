"""Packed integer layers (``qweight``/``qzeros``/``scales``: AutoRound's, GPTQ's and AWQ's
formats) as the per-layer statistics read them."""

from __future__ import annotations

from quantdask.errors import UnsupportedHere


def packed_shape(module) -> tuple[int, int] | None:
    """(inputs, outputs) of a packed layer (a ``qweight`` buffer; ``infeatures`` and
    ``outfeatures`` in AutoRound's kernels, ``in_features`` and ``out_features`` in
    gptqmodel's), or None for any other module."""
    import torch

    if not isinstance(getattr(module, "qweight", None), torch.Tensor):
        return None
    for names in (("infeatures", "outfeatures"), ("in_features", "out_features")):
        rows, columns = (getattr(module, name, None) for name in names)
        if isinstance(rows, int) and isinstance(columns, int):
            return rows, columns
    return None


def dequantize_packed_layer(module):
    """A packed layer's weight as float32 (out, in), read through its own forward on the
    identity (whatever its packing and kernel), less its bias; None for any other module.

    An AWQ layer raises instead (its layer is counted unmeasured, with the reason): AWQ scales
    each input channel of its weight up and the op before it down by the same factor, so its
    weight, and its output on its own input, differ from the original's by those factors, not
    by rounding alone."""
    import torch

    shape = packed_shape(module)
    if shape is None:
        return None
    width = shape[0]
    if "awq" in type(module).__name__.lower():
        raise UnsupportedHere("AWQ rescaled this layer's input channels (and the op before it): "
                              "its weight is not comparable with the original's")
    scales = module.scales
    # The kernels dequantize in the scales' dtype, then cast to the input's, so any input
    # dtype reads the same weight, exactly (one term per output). On the CPU, float32: its
    # half-precision matmul has no fast kernel (1.2 s per 512 rows of a 1024 x 2816 layer,
    # 40 s per decoder layer, against 0.02 s).
    dtype = torch.float32 if scales.device.type == "cpu" else scales.dtype
    rows = []
    with torch.no_grad():
        for start in range(0, width, 512):  # bounded memory on wide layers
            stop = min(width, start + 512)
            eye = torch.zeros(stop - start, width, dtype=dtype, device=scales.device)
            eye[:, start:stop] = torch.eye(stop - start, dtype=dtype, device=scales.device)
            out = module(eye).float()
            if getattr(module, "bias", None) is not None:
                out = out - module.bias.float()
            rows.append(out)
    return torch.cat(rows).t().contiguous()
