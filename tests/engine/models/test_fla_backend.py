"""engine.models.layers.fla_backend's sync-free varlen state pass: `_chunk_fwd_h_host`
launches fla's chunk_fwd_kernel_h exactly as fla's own chunk_fwd_h does (same grid, same
arguments, same split offsets), with the offsets computed on the host. fla's kernels need
a GPU, so the kernel is replaced by a recorder here (both functions launch the recorder);
on the GPU tools/check_long_ranges_gpu.py runs the real one."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("fla.ops.common.chunk_h", reason="fla-core is not installed")

from fla.ops.common import chunk_h  # noqa: E402

from engine.models.layers import fla_backend  # noqa: E402


class _Recorder:
    def __init__(self) -> None:
        self.launches = []

    def __getitem__(self, grid):
        def launch(**kw):
            self.launches.append((grid, kw))
        return launch


def _grid_size(grid) -> int:
    (n,) = grid({"BK": 32, "BV": 16})
    return n


@pytest.mark.parametrize("split_size", [None, 128])
def test_host_offsets_launch_the_kernel_as_fla_does(monkeypatch, split_size):
    rec = _Recorder()
    monkeypatch.setattr(chunk_h, "chunk_fwd_kernel_h", rec)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, ())))
    lens = torch.randint(1, 300, (5,), generator=gen)
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
    T, H, K, V = int(cu[-1]), 2, 64, 32
    k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, V)
    g = torch.randn(1, T, H)
    kw = dict(g=g, output_final_state=True, cu_seqlens=cu, chunk_size=64, split_size=split_size)
    want_h, want_ht = chunk_h.chunk_fwd_h(k, v, **kw)  # fla's (reads the offsets back: fine on the CPU)
    monkeypatch.setattr(fla_backend._HOST_CU, "cu", cu.clone(), raising=False)
    got_h, got_ht = fla_backend._chunk_fwd_h_host(k, v, **kw)
    assert got_h.shape == want_h.shape and got_h.dtype == want_h.dtype
    assert got_ht.shape == want_ht.shape and got_ht.dtype == want_ht.dtype
    (want_grid, want), (got_grid, got) = rec.launches
    assert _grid_size(got_grid) == _grid_size(want_grid)
    assert set(got) == set(want)
    for name, x in want.items():
        y = got[name]
        if isinstance(x, torch.Tensor) and name not in ("h", "ht"):  # h/ht: fresh outputs of each call
            assert torch.equal(y, x), name
        elif not isinstance(x, torch.Tensor):
            assert y == x, name


def test_without_a_host_copy_fla_runs_its_own_function(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(chunk_h, "chunk_fwd_kernel_h", rec)
    called = []
    orig = chunk_h.chunk_fwd_h
    monkeypatch.setattr(chunk_h, "chunk_fwd_h", lambda *a, **kw: called.append(1) or orig(*a, **kw))
    cu = torch.tensor([0, 40, 100])
    k, v = torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 16)
    monkeypatch.setattr(fla_backend._HOST_CU, "cu", None, raising=False)
    fla_backend._chunk_fwd_h_host(k, v, g=torch.randn(1, 100, 2), cu_seqlens=cu)
    assert called == [1] and len(rec.launches) == 1


def test_installed_over_the_names_simple_gla_and_gla_call():
    from fla.ops.gla import chunk as gla_chunk
    from fla.ops.simple_gla import chunk as simple_gla_chunk

    assert fla_backend.install_host_offsets() is True  # fla-core 0.6's signature
    assert simple_gla_chunk.chunk_fwd_h is fla_backend._chunk_fwd_h_host
    assert gla_chunk.chunk_fwd_h is fla_backend._chunk_fwd_h_host
    assert chunk_h.chunk_fwd_h is not fla_backend._chunk_fwd_h_host  # fla's own stays for everything else


def test_a_delta_varlen_call_hands_fla_the_chunk_indices_it_would_build_itself(monkeypatch):
    """fla_chunk gives chunk_gated_delta_rule the chunk indices fla's own
    prepare_chunk_indices builds from the host cu_seqlens (fla would move them to the
    device with a blocking copy); the call is recorded, not run (fla needs a GPU)."""
    import fla.ops.gated_delta_rule as gdr
    from fla.ops.utils.index import prepare_chunk_indices

    from engine.models.layers.linear_ops import RecurrenceInputs

    seen = {}

    def record(q, k, v, g, beta, **kw):
        seen.update(kw)
        return v, torch.zeros(3, q.shape[2], q.shape[3], v.shape[3])

    monkeypatch.setattr(gdr, "chunk_gated_delta_rule", record)
    t, h, d = 200, 2, 8
    inp = RecurrenceInputs(q=torch.randn(1, t, h, d), k=torch.randn(1, t, h, d), v=torch.randn(1, t, h, d),
                           log_decay=-torch.rand(1, t, h), beta=torch.rand(1, t, h), scale=d ** -0.5)
    cu = torch.tensor([0, 70, 130, 200])
    fla_backend.fla_chunk("delta", inp, None, cu_seqlens=cu)
    want = prepare_chunk_indices(cu.clone(), fla_backend.DELTA_CHUNK, cu_seqlens_cpu=cu.clone())
    assert torch.equal(seen["chunk_indices"], want) and want.shape == (2 + 1 + 2, 2)
    assert torch.equal(seen["cu_seqlens"], cu) and torch.equal(seen["cu_seqlens_cpu"], cu)
