"""The 1-bit compressed all-reduce with error feedback (DeepSpeed's, Tang et al. 2021).

A flat fp32 tensor x [n], the concatenation of tensors of `sizes` elements (a DP bucket's
params), is averaged over a group of w ranks, 1 bit per element each way:

1. worker: x + worker error, zero-padded to w chunks of c elements (c a multiple of 8); the
   tensor boundaries and the chunk boundaries cut it into pieces (a piece: one tensor's
   elements within one chunk; the padding is a piece of its own), and with a `block` size
   every `block` elements from each tensor's start (`--onebit-block-size`). Each chunk becomes sign bits
   (x >= 0 -> +1, else -1; packed 8 per byte) and one scale ||piece|| / sqrt(piece size) per
   piece; the worker error keeps what the compression lost.
2. all-to-all: chunk k of every rank goes to group rank k, which "serves" it.
3. server: the mean of the w decompressed chunks + server error [c], compressed again (signs
   and a scale per piece); the server error keeps what that lost.
4. all-gather of every server's compressed chunk; every rank decompresses the same [n].

A scale per piece, not per chunk: a chunk spanning a large-grad and a small-grad tensor would
give the small one the large one's scale (DeepSpeed compresses tensor by tensor, one scale
per tensor at the worker and per server chunk). Smaller pieces (blocks) follow the
magnitudes more closely (an embedding's rare-token rows, a bias whose grad is rounding noise
beside its neighbours') for 4 more bytes per block. Each payload is the packed signs followed by
P scales (P: the most pieces in one chunk; 4 bytes each, zero for a chunk's missing ones; one
uint8 row), so a step is one all-to-all and one all-gather through megalite.mpu.comm (whose
byte counts are the real ones): it counts w (c / 8 + 4 P) bytes, against 4 n for an fp32
all-reduce's payload (about 32 times fewer while P << c; on the wire, ring collectives, the
ratio is the same).
"""
import torch
import torch.distributed as dist

from megalite.mpu import comm

BITS = 8
SCALE_BYTES = 4  # one fp32 scale, sent as 4 uint8


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


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[..., 8 k] float -> [..., k] uint8: bit i of byte j is 1 where x[8 j + i] >= 0."""
    bits = (x >= 0).reshape(*x.shape[:-1], -1, BITS).to(torch.uint8)
    weights = torch.tensor([1 << i for i in range(BITS)], dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 8 k] bool, True for +1 (the inverse of `pack_signs`)."""
    shifts = torch.arange(BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(*packed.shape[:-1], -1)


class Pieces:
    """Chunks [r, c] cut into pieces of `rows` lengths (per row; `sizes` flat, `lengths` on the
    device); `slots` [pieces] (long), each piece's place in the rows' [r, P] scales
    (row-major; P = `per_row`)."""

    def __init__(self, rows: list[list[int]], per_row: int, device: torch.device) -> None:
        self.rows, self.per_row, self.width = len(rows), per_row, sum(rows[0])
        self.sizes = [n for row in rows for n in row]
        self.lengths = torch.tensor(self.sizes, device=device)
        self.slots = torch.tensor([r * per_row + i for r, row in enumerate(rows)
                                   for i in range(len(row))], device=device)

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r, c] -> (their 1-bit approximation [r, c], payload [r, c / 8 + 4 P] uint8:
        packed signs, then each piece's fp32 scale ||piece|| / sqrt(its length))."""
        norms = torch.stack(torch._foreach_norm(x.view(-1).split(self.sizes)))  # one launch
        scales = norms / self.lengths.sqrt()
        table = torch.zeros(self.rows * self.per_row, device=x.device)
        table[self.slots] = scales
        approx = torch.where(x >= 0, self.spread(scales), -self.spread(scales))
        payload = torch.cat([pack_signs(x), table.view(self.rows, -1).view(torch.uint8)], -1)
        return approx, payload

    def decompress(self, payload: torch.Tensor) -> torch.Tensor:
        """Payload rows [r, c / 8 + 4 P] uint8 -> their values [r, c] fp32."""
        signs = unpack_signs(payload[:, :-SCALE_BYTES * self.per_row])
        table = payload[:, -SCALE_BYTES * self.per_row:].contiguous().view(torch.float32)
        scales = self.spread(table.reshape(-1)[self.slots])
        return torch.where(signs, scales, -scales)

    def spread(self, scales: torch.Tensor) -> torch.Tensor:
        """Per piece [pieces] -> per element [r, c]."""
        return scales.repeat_interleave(self.lengths, output_size=self.rows * self.width
                                        ).view(self.rows, self.width)


class CompressedAllReduce:
    """The averaging of one flat tensor [n] (tensors of `sizes` elements, concatenated) over
    one group, with its two error buffers (fp32): `worker_error` [w c] on every rank,
    `server_error` [c] for the chunk this rank serves (group rank k serves chunk k)."""

    def __init__(self, n: int, world: int, device: torch.device,
                 sizes: list[int] | None = None, block: int = 0) -> None:
        self.n, self.world, self.chunk = n, world, chunk_size(n, world)
        self.sizes, self.block = sizes, block
        self.worker_error = torch.zeros(world * self.chunk, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)
        self.lengths = piece_lengths(n, world, sizes, block)
        self.per_row = max(len(row) for row in self.lengths)
        self.pieces = Pieces(self.lengths, self.per_row, device)
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
        buffer = self.worker_error.clone()
        buffer[:self.n] += x
        approx, payload = self.pieces.compress(buffer.view(self.world, self.chunk))
        self.worker_error.copy_(buffer - approx.view(-1))
        splits = [1] * self.world
        received = comm.all_to_all_single(payload, splits, splits, group)
        if self.served is None:  # this rank's chunk: as received from w ranks, then alone
            row = self.lengths[dist.get_rank(group)]
            self.served = (Pieces([row] * self.world, self.per_row, x.device),
                           Pieces([row], self.per_row, x.device))
        served = self.served[0].decompress(received).mean(0, keepdim=True) + self.server_error
        approx, payload = self.served[1].compress(served)
        self.server_error.copy_((served - approx).view(-1))
        gathered = torch.empty(self.world, payload.shape[-1], dtype=torch.uint8,
                               device=x.device)
        comm.all_gather_into(gathered, payload, group)
        x.copy_(self.pieces.decompress(gathered).view(-1)[:self.n])
