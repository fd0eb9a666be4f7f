"""attnzero — attention from zero (从零实现 Attention).

``softmax(Q Kᵀ / √d_k + bias) V``, written to be read line by line (``reference.py``) and computed
fast with little memory by the other backends. Layout (B, H, L, D); masks say where attention MAY
go (True / non-zero = attend); a query row with nothing to attend to gives 0, never NaN.
"""

from . import distributed, masks
from .cache import KVCache
from .checks import ArgumentError, ArgumentTypeError
from .functional import attention, attention_varlen, attention_weights
from .masks import Mask
from .modules import MultiHeadAttention, ScaledDotProductAttention
from .rotary import RotaryEmbedding
from .sdpa import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "KVCache",
    "Mask",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "ScaledDotProductAttention",
    "__version__",
    "attention",
    "attention_varlen",
    "attention_weights",
    "distributed",
    "masks",
    "scaled_dot_product_attention",
]
