"""The custom op ``tvmattn::attention``: its schema and fake implementation (opcheck), the drop-in
function inside `torch.compile(fullgraph=True)` (no graph break) and under `torch.export`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tvmattn.torch  # noqa: E402,F401  (registers torch.ops.tvmattn.attention)
from tvmattn.compiler.verify import TOLERANCE  # noqa: E402
from tvmattn.torch import scaled_dot_product_attention  # noqa: E402


class Block(torch.nn.Module):
    """A projection, then attention on (B, n, h, d) reshaped as transformers does, then a projection."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = heads * head_dim
        self.qkv = torch.nn.Linear(width, width + 2 * kv_heads * head_dim)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x, attention=scaled_dot_product_attention):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, *(2 * [self.kv_heads * self.head_dim])], -1)
        q, k, v = (t.reshape(b, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


def assert_close(out, ref):
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOLERANCE["float32"], err


def test_opcheck():
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 8)
    mask = torch.randn(9, 11)
    for args in ((q, k, v, None, False, None, True), (q, k, v, mask, False, 0.5, True),
                 (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None, True, None, True)):
        torch.library.opcheck(torch.ops.tvmattn.attention.default, args)


@pytest.mark.parametrize("backend, dynamic", [
    ("aot_eager", False), ("aot_eager", True),
    pytest.param("inductor", True, marks=pytest.mark.slow),  # builds C++ around the op: tens of seconds
])
def test_torch_compile_fullgraph(backend, dynamic):
    torch._dynamo.reset()
    block = Block().eval()
    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=backend)
    with torch.no_grad():
        for n in (7, 12):
            x = torch.randn(2, n, 64)
            assert_close(compiled(x), block(x, attention=F.scaled_dot_product_attention))


def test_torch_export():
    block = Block().eval()
    x = torch.randn(1, 10, 64)
    with torch.no_grad():
        program = torch.export.export(block, (x,))
        assert "tvmattn.attention" in str(program.graph)
        assert_close(program.module()(x), block(x, attention=F.scaled_dot_product_attention))
