/* The compressed all-reduce's element-wise work on the host, one pass per stage
   (megalite/distributed/native_signs.py compiles and loads it; compressed.py's Pieces
   documents the layout). Rows of `width` fp32 elements, flat, cut into pieces that tile them
   row-major (`lengths`, np of them; none crosses a row); a row's packed signs start at
   `signs` + row * `stride`, bit i of byte j the sign of the row's element 8 j + i
   (1 where x >= 0, so -0.0 is +1). */
#include <stdint.h>
#include <string.h>

#define BLOCK 4096   /* elements summed in fp32 before the fp64 total */
#define TABLE_MIN 256 /* whole bytes from which a piece fills its byte -> values table */

/* e[:nx] += x; sumsq[p] = sum of e^2 over piece p of e, after the addition. */
void add_sumsq(float *e, const float *x, int64_t nx, const int64_t *lengths, int64_t np,
               double *sumsq) {
    int64_t start = 0;
    for (int64_t p = 0; p < np; p++) {
        int64_t end = start + lengths[p];
        double total = 0;
        for (int64_t i = start; i < end; i += BLOCK) {
            int64_t stop = i + BLOCK < end ? i + BLOCK : end;
            int64_t added = stop < nx ? stop : (i > nx ? i : nx), j = i;
            float acc[8] = {0};
            for (; j + 8 <= added; j += 8)
                for (int k = 0; k < 8; k++) {
                    float v = e[j + k] + x[j + k];
                    e[j + k] = v;
                    acc[k] += v * v;
                }
            for (; j < added; j++) {
                e[j] += x[j];
                acc[0] += e[j] * e[j];
            }
            for (; j + 8 <= stop; j += 8)
                for (int k = 0; k < 8; k++) acc[k] += e[j + k] * e[j + k];
            for (; j < stop; j++) acc[0] += e[j] * e[j];
            for (int k = 0; k < 8; k++) total += acc[k];
        }
        sumsq[p] = total;
        start = end;
    }
}

static inline void set_bit(uint8_t *bytes, int64_t i, int bit) {
    bytes[i >> 3] = (uint8_t)((bytes[i >> 3] & ~(1u << (i & 7))) | ((unsigned)bit << (i & 7)));
}

/* Packs the signs of e and leaves e - sign(e) * scales[p] in e (the error). */
void compress(float *e, int64_t width, const int64_t *lengths, int64_t np,
              const float *scales, uint8_t *signs, int64_t stride) {
    int64_t start = 0;
    for (int64_t p = 0; p < np; p++) {
        int64_t end = start + lengths[p], row = start / width, off = row * width;
        uint8_t *bytes = signs + row * stride;
        float s = scales[p];
        int64_t whole = (start + 7) & ~7LL, tail = end & ~7LL, i = start;
        if (whole > end) whole = end;
        for (; i < whole; i++) { /* the piece's first byte, shared with the piece before */
            int bit = e[i] >= 0;
            e[i] -= bit ? s : -s;
            set_bit(bytes, i - off, bit);
        }
        for (; i < tail; i += 8) {
            unsigned byte = 0;
            for (int k = 0; k < 8; k++) {
                float v = e[i + k];
                int bit = v >= 0;
                byte |= (unsigned)bit << k;
                e[i + k] = v - (bit ? s : -s);
            }
            bytes[(i - off) >> 3] = (uint8_t)byte;
        }
        for (; i < end; i++) {
            int bit = e[i] >= 0;
            e[i] -= bit ? s : -s;
            set_bit(bytes, i - off, bit);
        }
        start = end;
    }
}

/* The first `count` elements' sign * scales[p]: written to out[i] (fold 0), or, with fold 1,
   added to out[i - row * width] (every row into the same [width]). */
void decompress(const uint8_t *signs, int64_t stride, int64_t width, const int64_t *lengths,
                int64_t np, const float *scales, float *out, int64_t count, int fold) {
    float table[256][8]; /* byte -> its 8 values, for a piece of TABLE_MIN whole bytes */
    int64_t start = 0;
    for (int64_t p = 0; p < np && start < count; p++) {
        int64_t end = start + lengths[p], row = start / width, off = row * width;
        const uint8_t *bytes = signs + row * stride;
        float *o = out + (fold ? 0 : off), s = scales[p];
        if (end > count) end = count;
        int64_t whole = (start + 7) & ~7LL, tail = end & ~7LL, i = start - off;
        if (whole > end) whole = end;
        whole -= off, tail -= off, end -= off; /* from here on, i counts within the row */
        int table_ok = tail - whole >= 8 * TABLE_MIN;
        for (int v = 0; v < 256 && table_ok; v++)
            for (int k = 0; k < 8; k++) table[v][k] = (v >> k) & 1 ? s : -s;
        for (; i < whole; i++) {
            float v = (bytes[i >> 3] >> (i & 7)) & 1 ? s : -s;
            o[i] = fold ? o[i] + v : v;
        }
        for (; i < tail; i += 8) {
            unsigned byte = bytes[i >> 3];
            if (table_ok && fold)
                for (int k = 0; k < 8; k++) o[i + k] += table[byte][k];
            else if (table_ok)
                memcpy(o + i, table[byte], sizeof table[0]);
            else
                for (int k = 0; k < 8; k++) {
                    float v = (byte >> k) & 1 ? s : -s;
                    o[i + k] = fold ? o[i + k] + v : v;
                }
        }
        for (; i < end; i++) {
            float v = (bytes[i >> 3] >> (i & 7)) & 1 ? s : -s;
            o[i] = fold ? o[i] + v : v;
        }
        start = end + off;
    }
}
