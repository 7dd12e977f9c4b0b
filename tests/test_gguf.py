"""GGUF weights (ComfyUI-GGUF's single files): the pool's dequantisation against the gguf
package's numpy reference, the file reader, and GGUF files through the pool."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from workers.loading import gguf_quant as gq  # noqa: E402

_K_SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fp16 scales in a block


def _blocks_for(qtype: str, shape, rng) -> np.ndarray:
    """Test bytes of a tensor: the gguf package's own quantisation where it has one, else
    random blocks whose fp16 scales are finite (every bit pattern of the rest is valid)."""
    T = gguf.GGMLQuantizationType[qtype]
    w = rng.standard_normal(shape).astype(np.float32)
    try:
        return np.ascontiguousarray(gguf.quants.quantize(w, T)).view(np.uint8)
    except NotImplementedError:
        pass
    _, block, size = gq.TYPES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block * size), dtype=np.uint8)
    b = raw.reshape(-1, size)
    for p in _K_SCALE_BYTES[qtype]:
        d = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16)
        b[:, p:p + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", list(gq.TYPES))
def test_dequantize_equals_gguf_numpy(qtype):
    """Every supported type, bit for bit against gguf.quants.dequantize, and its block
    layout (values, bytes) and type id as the gguf package defines them."""
    T = gguf.GGMLQuantizationType[qtype]
    tid, block, size = gq.TYPES[qtype]
    assert (T.value, gguf.GGML_QUANT_SIZES[T]) == (tid, (block, size))
    shape = (6, 512)
    raw = _blocks_for(qtype, shape, np.random.default_rng(tid))
    assert raw.nbytes == gq.tensor_bytes(qtype, shape)
    ref = gguf.quants.dequantize(raw, T).reshape(shape)
    got = gq.dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_dequantize_compiles_without_graph_breaks(qtype):
    """The dequantisation traces into one graph (fullgraph) and gives the same values."""
    shape = (4, 256)
    raw = torch.from_numpy(_blocks_for(qtype, shape, np.random.default_rng(1)))
    eager = gq.dequantize(raw, qtype, shape, torch.bfloat16)
    fn = torch.compile(lambda r: gq.dequantize(r, qtype, shape, torch.bfloat16),
                       fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(raw), eager)
