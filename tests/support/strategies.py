"""Hypothesis strategies the fuzz tests share."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

# Every float32 bit pattern (NaN payloads and infinities included), from its 32 bits.
# hypothesis 6.170's own `floats(width=32)` sometimes fails inside (OverflowError while it
# narrows a value just past float32's largest), which failed the codec fuzz tests at random.
float32s = st.integers(0, 2**32 - 1).map(
    lambda bits: float(np.array(bits, dtype=np.uint32).view(np.float32)))
