"""The compressed all-reduce's bit work (megalite.distributed.compressed) against references
written here element by element, bit for bit on edge values (+0.0 and -0.0 are +1 as x >= 0
says; infinities, denormals, values around 1):

- pack_signs: bit i of byte j is x[8 j + i] >= 0;
- Pieces.decompress: each element is +scale of its piece where its bit is set, else -scale,
  with pieces that start and end inside a byte, into the scratch and into a shorter `out`,
  through a table per piece (long pieces) and through one table times each element's scale;
  the norms through a list of views and through one segment reduction (many pieces);
- Pieces.compress_: the packed signs and ||piece|| / sqrt(piece size) per piece in the
  payload, and x left as x - sign(x) scale;
- Pieces.decompress_mean: the rows' mean of the decompressed values;

each through the torch ops and through the native kernels (signs.c, where a C compiler is).

The single-process pieces only; the collectives are test_onebit.py's.
"""
import shutil

import pytest
import torch

from megalite.distributed import compressed, native_signs
from megalite.distributed.compressed import BITS, Pieces, pack_signs

EDGES = [0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 1.0, -1.0, 3e38, -3e38]
ROWS = [[5, 20, 3, 12], [17, 23], [1, 1, 38]]  # 3 chunks of 40: pieces cut inside bytes


def values(n: int, seed: int) -> torch.Tensor:
    """[n] fp32: normal values with the edge values scattered in."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    edges = torch.tensor(EDGES)
    where = torch.randperm(n, generator=generator)[:n // 4]
    x[where] = edges[torch.arange(len(where)) % len(edges)]
    return x


def reference_pack(x: torch.Tensor) -> torch.Tensor:
    """[..., 8 k] -> [..., k] uint8, byte by byte from Python ints."""
    signs = (x >= 0).reshape(-1, BITS).tolist()
    packed = [sum(int(bit) << i for i, bit in enumerate(byte)) for byte in signs]
    return torch.tensor(packed, dtype=torch.uint8).view(*x.shape[:-1], -1)


def element_scales(rows: list[list[int]], scales: list[float]) -> torch.Tensor:
    """Per element of the flat rows, its piece's scale."""
    sizes = [n for row in rows for n in row]
    return torch.tensor([s for s, n in zip(scales, sizes) for _ in range(n)])


def test_pack_signs_matches_the_bytes_of_python_ints():
    x = values(3 * 64, seed=0).view(3, 64)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(packed, reference_pack(x))
    assert pack_signs(torch.tensor([-0.0] * 8)).item() == 255  # -0.0 >= 0: +1


@pytest.mark.parametrize("native,table_min_length,many_pieces",
                         ((False, 1, 4096), (False, 10 ** 9, 4096), (False, 10 ** 9, 1),
                          (True, 10 ** 9, 4096)))
def test_decompress_and_compress_match_the_elementwise_reference(native, table_min_length,
                                                                 many_pieces, monkeypatch):
    """The torch ops (a table per piece or one shared; norms by a list of views or a segment
    reduction) and the native kernels (signs.c)."""
    if native and native_signs.kernels() is None:
        assert not shutil.which("cc"), "a C compiler is here but signs.c did not build"
        pytest.skip("no C compiler: the native kernels are not built")
    monkeypatch.setattr(compressed, "TABLE_MIN_LENGTH", table_min_length)
    monkeypatch.setattr(compressed, "MANY_PIECES", many_pieces)
    pieces = Pieces(ROWS, per_row=4, device=torch.device("cpu"), native=native)
    assert (pieces.kernels is not None) == native
    assert native or pieces.piece_tables == (table_min_length == 1)
    x = values(len(ROWS) * sum(ROWS[0]), seed=1)
    x[5:25] = 0.0  # a piece of zeros: scale 0, sent as +-0.0
    x[6] = -0.0
    assert_matches_the_reference(pieces, ROWS, x)


def test_native_kernels_on_long_pieces_match_the_elementwise_reference():
    """Pieces of 256 whole bytes and more (signs.c's byte -> values tables), cut inside
    bytes; and sizes that do not match are one ValueError, never a wild pointer."""
    if native_signs.kernels() is None:
        assert not shutil.which("cc"), "a C compiler is here but signs.c did not build"
        pytest.skip("no C compiler: the native kernels are not built")
    rows = [[4101, 3, 4200], [8304]]
    pieces = Pieces(rows, per_row=3, device=torch.device("cpu"))
    x = values(2 * 8304, seed=2).clamp(-1e3, 1e3)  # finite: every piece's norm is checked
    assert_matches_the_reference(pieces, rows, x)
    payload = pieces.compress_(x.clone().view(2, -1))
    with pytest.raises(ValueError, match="do not match in size"):
        native_signs.compress(pieces.kernels, x[8:].view(2, -1).contiguous(), pieces.lengths,
                              pieces.scales_of(payload), payload)


def assert_matches_the_reference(pieces: Pieces, rows: list[list[int]], x: torch.Tensor) -> None:
    """Compress rows of x (flat) with `pieces`, then decompress: signs, scales, errors, values
    (into the scratch and into shorter outs) and the rows' mean against the element-wise
    reference."""
    width, count = sum(rows[0]), sum(len(row) for row in rows)
    compressed_rows = x.clone().view(len(rows), width)
    payload = pieces.compress_(compressed_rows)

    sizes = [n for row in rows for n in row]
    sign_bytes = width // BITS
    assert torch.equal(payload[:, :sign_bytes], reference_pack(x.view(len(rows), width)))
    sent = payload[:, sign_bytes:].contiguous().view(torch.float32)
    sent = [v for r, row in enumerate(rows) for v in sent[r, :len(row)].tolist()]
    checked = [(got, piece) for got, piece in zip(sent, x.split(sizes))
               if piece.abs().max() < 1e10]  # the fp32 sum of squares does not overflow
    assert len(checked) >= 3
    for got, piece in checked:
        ref = piece.double().norm().item() / len(piece) ** 0.5
        assert abs(got - ref) <= 1e-6 * ref, (got, ref)

    # decompressing the payload: +-its own scales, bit for bit; then x - that is the error
    want = torch.where(x >= 0, 1.0, -1.0) * element_scales(rows, sent)
    assert len(sent) == count
    got = pieces.decompress(payload)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(compressed_rows.view(-1).view(torch.int32), (x - want).view(torch.int32))
    for numel in (len(want) - 3, 8 * 9 + 5):  # a shorter out: whole bytes and a tail
        out = torch.full((numel,), 7.0)
        pieces.decompress(payload, out)
        assert torch.equal(out.view(torch.int32), want[:numel].view(torch.int32))
    # the server's mean over the rows (its sum's rounding order is the path's own)
    torch.testing.assert_close(pieces.decompress_mean(payload),
                               want.view(len(rows), width).mean(0), rtol=1e-6, atol=0,
                               equal_nan=True)


def test_a_failed_build_falls_back_to_the_torch_ops_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path))
    native_signs.kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="building signs.c with false into .* failed"):
            assert native_signs.kernels() is None
        assert Pieces(ROWS, per_row=4, device=torch.device("cpu")).kernels is None
    finally:
        native_signs.kernels.cache_clear()
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind
