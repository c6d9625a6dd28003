"""The 1-bit compressed all-reduce with error feedback (DeepSpeed's, Tang et al. 2021).

A flat fp32 tensor x [n], the concatenation of tensors of `sizes` elements (a DP bucket's
params), is averaged over a group of w ranks, 1 bit per element each way:

1. worker: x + worker error, zero-padded to w chunks of c elements (c a multiple of 8); the
   tensor boundaries and the chunk boundaries cut it into pieces (a piece: one tensor's
   elements within one chunk; the padding is a piece of its own), and with a `block` size
   every `block` elements from each tensor's start (`--onebit-block-size`). Each chunk
   becomes sign bits (x >= 0 -> +1, else -1; packed 8 per byte) and one scale
   ||piece|| / sqrt(piece size) per piece; the worker error keeps what the compression lost.
2. all-to-all: chunk k of every rank goes to group rank k, which "serves" it.
3. server: the mean of the w decompressed chunks + server error [c], compressed again (signs
   and a scale per piece); the server error keeps what that lost.
4. all-gather of every server's compressed chunk; every rank decompresses the same [n].

A scale per piece, not per chunk: a chunk spanning a large-grad and a small-grad tensor would
give the small one the large one's scale (DeepSpeed compresses tensor by tensor, one scale
per tensor at the worker and per server chunk). Smaller pieces (blocks) follow the
magnitudes more closely (an embedding's rare-token rows, a bias whose grad is rounding noise
beside its neighbours') for 4 more bytes per block. Each payload is the packed signs
followed by P scales (P: the most pieces in one chunk; 4 bytes each, zero for a chunk's
missing ones; one uint8 row), so a step is one all-to-all and one all-gather through
megalite.mpu.comm (whose byte counts are the real ones): it counts w (c / 8 + 4 P) bytes,
against 4 n for an fp32 all-reduce's payload (about 32 times fewer while P << c; on the
wire, ring collectives, the ratio is the same).

The element-wise work is a few passes over memory, in place: x is added into the worker
error, whose pieces' norms are taken (one segment reduction when the pieces are many);
signs are compared into bools and packed eight at a time as one int64 times a constant;
decompressing is one lookup per byte in a [256, 8] table of +-its piece's scale while pieces
are long (8 KiB per piece), else in one table of +-1 times each element's scale; the error
keeps x minus that. Work buffers are reused across calls (`scratch`). Up to MANY_PIECES
pieces the results are bit for bit those of the plain where / repeat_interleave form. On the
host the same stages run as native_signs' C kernels, one pass each, by default.
"""
import bisect
import functools
import itertools

import torch
import torch.distributed as dist

from megalite.distributed import native_signs
from megalite.mpu import comm

BITS = 8
SCALE_BYTES = 4  # one fp32 scale, sent as 4 uint8
PACK_MULTIPLIER = 0x0102040810204080  # byte j of it: bit 7 - j
TABLE_MIN_LENGTH = 1 << 15  # mean piece length from which each piece gets its own table
MANY_PIECES = 4096  # from there on the norms are one segment reduction, not a list of views


def chunk_size(n: int, world: int) -> int:
    """Elements per chunk: n split into `world` chunks, rounded up to whole bytes of bits."""
    return -(-n // (world * BITS)) * BITS


def piece_lengths(n: int, world: int, sizes: list[int] | None = None, block: int = 0
                  ) -> list[list[int]]:
    """Per chunk, the lengths of its pieces in order: [n] (the concatenation of tensors of
    `sizes` elements, default one tensor; a shortfall below n is one more), zero-padded to
    `world` chunks of `chunk_size(n, world)`, cut at every tensor and chunk boundary and,
    with `block` > 0, every `block` elements from each tensor's start."""
    c, sizes = chunk_size(n, world), list(sizes or [n])
    if sum(sizes) > n:
        raise ValueError(f"tensor sizes sum to {sum(sizes)}, above the {n} elements")
    starts = torch.tensor([0, *sizes, n - sum(sizes)]).cumsum(0).tolist()
    cuts = {k * c for k in range(world + 1)} | set(starts)
    for start, end in zip(starts, starts[1:]) if block else ():
        cuts.update(range(start, end, block))
    cuts = sorted(cuts)
    out: list[list[int]] = [[] for _ in range(world)]
    for start, end in zip(cuts, cuts[1:]):
        out[start // c].append(end - start)
    return out


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A work buffer [numel] of `dtype` on `device`: the same memory on every call (grown to
    the largest numel asked), shared by all the compressed all-reduces of the process (they
    run one at a time). On the host a fresh allocation this large is fresh pages on every
    call, and their faults cost as much as the compression itself."""
    key = (device, dtype)
    if key not in _scratch or _scratch[key].numel() < numel:
        _scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return _scratch[key][:numel]


def pack_bits_(bits: torch.Tensor) -> torch.Tensor:
    """[..., 8 k] bool (contiguous) -> [..., k] int64 of 0..255: bit i of value j is
    bits[8 j + i]. Computed in `bits`' memory, which it overwrites: each 8 bools are read as
    one little-endian int64 (bool i in bits 8 i) and PACK_MULTIPLIER moves bit 8 i to bit
    56 + i (its partial products never overlap there)."""
    words = bits.view(torch.uint8).view(torch.int64)
    return words.mul_(PACK_MULTIPLIER).bitwise_right_shift_(56).bitwise_and_(0xFF)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[..., 8 k] float -> [..., k] uint8: bit i of byte j is 1 where x[8 j + i] >= 0."""
    return pack_bits_((x >= 0).contiguous()).to(torch.uint8)


@functools.cache
def sign_table(device: torch.device) -> torch.Tensor:
    """[256, 8] fp32 on `device`: row b is the signs byte b packs, +1.0 for a set bit."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(BITS)) & 1
    return (2.0 * bits - 1.0).to(device)


class Pieces:
    """Chunks [r, c] cut into pieces of `rows` lengths (per row; `sizes` flat, `lengths` on the
    device); `slots` [pieces] (long), each piece's place in the rows' [r, P] scales
    (row-major; P = `per_row`). A payload row: c / 8 bytes of packed signs (`sign_bytes`),
    then the row's P scales as 4 P bytes.

    Decompressing looks each byte's 8 values up in a table. While the pieces are long (on
    average TABLE_MIN_LENGTH elements or more: `piece_tables`), each has its [256, 8] table of
    +-its scale (8 KiB; `byte_counts`: how many bytes each piece's table serves, a byte going
    to the piece of its first element; the elements of a piece that shares its first byte
    with an earlier piece, `straddling` [e] in `straddling_pieces` [e], take their own scale
    after). Short pieces share one table of +-1, times each element's scale.

    On the host, with `native` and a C compiler, the same work is native_signs' one pass per
    stage instead (the signs and errors bit for bit the torch ops' for the same scales; the
    norms summed in another order)."""

    def __init__(self, rows: list[list[int]], per_row: int, device: torch.device,
                 native: bool = True) -> None:
        self.rows, self.per_row, self.width = len(rows), per_row, sum(rows[0])
        self.kernels = native_signs.kernels() if native and device.type == "cpu" else None
        self.sign_bytes = self.width // BITS
        self.sizes = [n for row in rows for n in row]
        self.lengths = torch.tensor(self.sizes, device=device)
        self.slots = torch.tensor([r * per_row + i for r, row in enumerate(rows)
                                   for i in range(len(row))], device=device)
        self.piece_tables = len(self.sizes) * TABLE_MIN_LENGTH <= self.rows * self.width
        ends = list(itertools.accumulate(self.sizes)) if self.piece_tables else []
        bounds = list(zip([0, *ends[:-1]], ends))
        first_byte = [-(-start // BITS) for start, _ in bounds]  # the first it starts
        self.byte_counts = [-(-end // BITS) - byte for byte, (_, end) in zip(first_byte, bounds)]
        self.table_offsets = [256 * p for p in range(len(bounds))]
        pairs = [(e, p) for p, (byte, (start, end)) in enumerate(zip(first_byte, bounds))
                 for e in range(start, min(end, byte * BITS))]
        self.straddling_list = [e for e, _ in pairs]  # ascending
        self.straddling = torch.tensor(self.straddling_list, dtype=torch.long, device=device)
        self.straddling_pieces = torch.tensor([p for _, p in pairs], dtype=torch.long,
                                              device=device)

    def compress_(self, x: torch.Tensor, added: torch.Tensor | None = None) -> torch.Tensor:
        """Rows x [r, c] (fp32, contiguous), `added` [<= r c] added into their start first
        -> payload [r, c / 8 + 4 P] uint8 (packed signs, then each piece's fp32 scale
        ||piece|| / sqrt(its length)); x becomes what the 1-bit approximation sign(x) scale
        lost."""
        if added is not None and (self.kernels is None or added.dtype != torch.float32
                                  or not added.is_contiguous()):
            x.view(-1)[:added.numel()] += added
            added = None
        scales = self._add_and_scale_(x, added)
        table = torch.zeros(self.rows * self.per_row, device=x.device)
        table[self.slots] = scales
        payload = torch.empty(self.rows, self.sign_bytes + SCALE_BYTES * self.per_row,
                              dtype=torch.uint8, device=x.device)
        payload[:, self.sign_bytes:] = table.view(self.rows, -1).view(torch.uint8)
        if self.kernels:
            native_signs.compress(self.kernels, x, self.lengths, scales, payload)
            return payload
        bits = scratch(x.numel(), torch.bool, x.device)
        torch.ge(x.view(-1), 0, out=bits)
        payload[:, :self.sign_bytes] = pack_bits_(bits.view(self.rows, -1))
        x.view(-1).sub_(self.decompress(payload))
        return payload

    def _add_and_scale_(self, x: torch.Tensor, added: torch.Tensor | None) -> torch.Tensor:
        """Each piece's ||piece|| / sqrt(its length) [pieces] fp32, of rows x [r, c] after
        `added` (native only, else None) is added into their start."""
        if self.kernels:
            sums = native_signs.add_sumsq(self.kernels, x, added, self.lengths)
            return sums.sqrt().div_(self.lengths.double().sqrt()).float()
        if len(self.sizes) <= MANY_PIECES:
            norms = torch.stack(torch._foreach_norm(x.view(-1).split(self.sizes)))
        else:
            norms = torch.segment_reduce(x.view(-1).square(), "sum", lengths=self.lengths)
            norms = norms.sqrt()
        return norms / self.lengths.sqrt()

    def scales_of(self, payload: torch.Tensor) -> torch.Tensor:
        """Payload rows [r, c / 8 + 4 P] uint8 -> their pieces' scales [pieces] fp32."""
        return payload[:, self.sign_bytes:].reshape(-1).clone().view(torch.float32)[self.slots]

    def decompress(self, payload: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Payload rows [r, c / 8 + 4 P] uint8 -> their values sign * scale, flat [r c] fp32:
        the first out.numel() of them into `out` (contiguous fp32), by default all of them
        into the fp32 `scratch` (valid until its next use)."""
        if out is None:
            out = scratch(self.rows * self.width, torch.float32, payload.device)
        scales = self.scales_of(payload)
        if self.kernels:
            native_signs.decompress(self.kernels, payload, self.width, self.lengths, scales, out)
            return out
        index = scratch(self.rows * self.sign_bytes, torch.int32, payload.device)
        index.view(self.rows, -1).copy_(payload[:, :self.sign_bytes])
        tables = sign_table(payload.device)
        if self.piece_tables:
            torch._foreach_add_(index.split(self.byte_counts), self.table_offsets)
            tables = (tables * scales[:, None, None]).view(-1, BITS)
        whole, rest = divmod(out.numel(), BITS)
        torch.index_select(tables, 0, index[:whole], out=out[:whole * BITS].view(-1, BITS))
        if rest:
            out[whole * BITS:] = tables.index_select(0, index[whole:whole + 1])[0, :rest]
        if not self.piece_tables:  # +-1 so far
            return out.mul_(scales.repeat_interleave(
                self.lengths, output_size=self.rows * self.width)[:out.numel()])
        fixed = bisect.bisect_left(self.straddling_list, out.numel())
        elements = self.straddling[:fixed]
        out[elements] = torch.copysign(scales[self.straddling_pieces[:fixed]], out[elements])
        return out

    def decompress_mean(self, payload: torch.Tensor) -> torch.Tensor:
        """Payload rows [r, c / 8 + 4 P] uint8 -> the mean of their values over the rows,
        [c] fp32 (in the fp32 `scratch`, valid until its next use)."""
        if not self.kernels:
            return self.decompress(payload).view(self.rows, -1).mean(0)
        out = scratch(self.width, torch.float32, payload.device).zero_()
        native_signs.decompress(self.kernels, payload, self.width, self.lengths,
                                self.scales_of(payload) / self.rows, out, fold=True)
        return out


class CompressedAllReduce:
    """The averaging of one flat tensor [n] (tensors of `sizes` elements, concatenated) over
    one group, with its two error buffers (fp32): `worker_error` [w c] on every rank,
    `server_error` [c] for the chunk this rank serves (group rank k serves chunk k)."""

    def __init__(self, n: int, world: int, device: torch.device,
                 sizes: list[int] | None = None, block: int = 0, native: bool = True) -> None:
        self.n, self.world, self.chunk = n, world, chunk_size(n, world)
        self.sizes, self.block, self.native = sizes, block, native
        self.worker_error = torch.zeros(world * self.chunk, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)
        self.lengths = piece_lengths(n, world, sizes, block)
        self.per_row = max(len(row) for row in self.lengths)
        self.pieces = Pieces(self.lengths, self.per_row, device, native)
        self.served: tuple[Pieces, Pieces] | None = None  # built on the first call

    def bytes_sent(self) -> int:
        """Payload bytes per call as megalite.mpu.comm counts them (`payload_bytes`)."""
        return self.payload_bytes(self.n, self.world, self.sizes, self.block)

    @staticmethod
    def payload_bytes(n: int, world: int, sizes: list[int] | None = None, block: int = 0
                      ) -> int:
        """Bytes megalite.mpu.comm counts for one call on n elements (tensors of `sizes`, cut
        in blocks of `block`) over `world` ranks (an fp32 all-reduce: 4 n): w - 1 payloads
        all-to-all and one all-gathered, w (c / 8 + 4 P)."""
        per_row = max(len(row) for row in piece_lengths(n, world, sizes, block))
        return world * (chunk_size(n, world) // BITS + SCALE_BYTES * per_row)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, group) -> None:
        """Replace x [n] (the same n on every rank of `group`) by the 1-bit average over
        `group`, the same values on every rank; updates both error buffers."""
        # the worker error: x added, sent, then what its compression lost
        payload = self.pieces.compress_(self.worker_error.view(self.world, -1), added=x)
        splits = [1] * self.world
        received = comm.all_to_all_single(payload, splits, splits, group)
        if self.served is None:  # this rank's chunk: as received from w ranks, then alone
            row = self.lengths[dist.get_rank(group)]
            self.served = (Pieces([row] * self.world, self.per_row, x.device, self.native),
                           Pieces([row], self.per_row, x.device, self.native))
        mean = self.served[0].decompress_mean(received)
        payload = self.served[1].compress_(self.server_error.view(1, -1), added=mean)
        gathered = torch.empty(self.world, payload.shape[-1], dtype=torch.uint8,
                               device=x.device)
        comm.all_gather_into(gathered, payload, group)
        direct = x.dtype == torch.float32 and x.is_contiguous()  # else through the scratch
        values = self.pieces.decompress(gathered, x if direct else None)
        if not direct:
            x.copy_(values[:self.n])
