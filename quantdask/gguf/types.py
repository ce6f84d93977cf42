"""llama.cpp's quantization types, as its quantizer names them (``tools/quantize``'s
``QUANT_OPTIONS``, llama.h's ``llama_ftype``), in the llama.cpp that llama-cpp-python 0.3.36
vendors (commit 0c1e570).

>>> ftype("Q4_K_M"), ftype("q4_k")
(15, 15)
"""

from __future__ import annotations

from quantdask.errors import SpecError

FTYPES = {
    "F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q5_K_S": 16,
    "Q5_1": 9, "Q5_0": 8, "Q4_K_M": 15, "Q4_K_S": 14, "Q4_1": 3, "Q4_0": 2, "Q3_K_L": 13,
    "Q3_K_M": 12, "Q3_K_S": 11, "Q2_K": 10, "Q2_K_S": 21, "IQ4_NL": 25, "IQ4_XS": 30,
    "IQ3_M": 27, "IQ3_S": 26, "IQ3_XS": 22, "IQ3_XXS": 23, "IQ2_M": 29, "IQ2_S": 28,
    "IQ2_XS": 20, "IQ2_XXS": 19, "IQ1_M": 31, "IQ1_S": 24, "TQ1_0": 36, "TQ2_0": 37,
}
"""Each type's name -> its ``llama_ftype``."""

ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
"""The quantizer's own shorthands."""

NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S",
                           "IQ3_XXS", "IQ3_XS"})
"""Types whose files hold tensors llama.cpp's quantizer refuses to make without an importance
matrix (``tensor_requires_imatrix`` in src/llama-quant.cpp): "this quantization requires an
imatrix!"."""


DEFAULT_TYPE = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K",
                "Q5_1": "Q5_1", "Q5_0": "Q5_0", "Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K",
                "Q4_1": "Q4_1", "Q4_0": "Q4_0", "Q3_K_L": "Q3_K", "Q3_K_M": "Q3_K",
                "Q3_K_S": "Q3_K", "Q2_K": "Q2_K", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS"}
"""Each file type a searched config may name -> its default tensor type
(``llama_ftype_get_default_type`` in src/llama-quant.cpp): the types whose tensors llama.cpp
quantizes without an importance matrix."""


def canonical(name: str) -> str:
    """The type's name as llama.cpp spells it (case-insensitive; an alias resolved), or a
    :class:`SpecError` listing the types it knows."""
    upper = str(name).strip().upper()
    upper = ALIASES.get(upper, upper)
    if upper not in FTYPES:
        raise SpecError("type", f"{name!r} is not a type llama.cpp's quantizer knows; its "
                                f"types: {', '.join(FTYPES)} (and {', '.join(ALIASES)})")
    return upper


def ftype(name: str) -> int:
    """The ``llama_ftype`` of ``name``."""
    return FTYPES[canonical(name)]
