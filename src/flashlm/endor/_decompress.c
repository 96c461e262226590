/* Endor decompression (Algorithm 2) on the CPU: one branch-free pass per row over a range of rows.
 *
 * Built on first use by flashlm.endor.kernel with the system C compiler; the torch gather in
 * codec.py is the reference and the fallback. Element bits are copied as unsigned integers of the
 * element's size, so the result is bit-exact whatever the dtype.
 */
#include <stdint.h>

/* Where each row's values start (offsets[rows] = total); returns the total number of set bits. */
int64_t endor_row_offsets(const uint8_t *bitmap, int64_t rows, int64_t row_bytes, int64_t *offsets) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++) {
        offsets[r] = total;
        const uint8_t *b = bitmap + r * row_bytes;
        for (int64_t i = 0; i < row_bytes; i++) total += __builtin_popcount(b[i]);
    }
    offsets[rows] = total;
    return total;
}

/* For every byte value and bit s: how many bits below s are set (where bit s's value sits among
 * the byte's values). Filled once by endor_init. */
static uint8_t below[256][8];

void endor_init(void) {
    for (int byte = 0; byte < 256; byte++)
        for (int s = 0, count = 0; s < 8; s++) {
            below[byte][s] = (uint8_t)count;
            count += (byte >> s) & 1;
        }
}

/* Rows [first, last) of a matrix. Within a bitmap byte each element's value index is independent
 * (base + bits set below it), so there is one dependent add per 8 elements. An element whose bit is
 * clear still loads a value, at an index inside the row's values or just past them, and masks it to
 * zero; rows whose values end the array take the checked path so that load never leaves it. */
#define DEFINE_DECOMPRESS(NAME, T)                                                                  \
    void NAME(const uint8_t *bitmap, const T *values, const int64_t *offsets, T *out, int64_t rows, \
              int64_t cols, int64_t row_bytes, int64_t first, int64_t last) {                      \
        for (int64_t r = first; r < last; r++) {                                                    \
            const uint8_t *b = bitmap + r * row_bytes;                                              \
            const T *v = values + offsets[r];                                                       \
            const int64_t n = offsets[r + 1] - offsets[r];                                          \
            T *o = out + r * cols;                                                                  \
            int64_t k = 0, j = 0;                                                                   \
            if (offsets[r + 1] + 8 <= offsets[rows]) {                                              \
                for (; j + 8 <= cols; j += 8) {                                                     \
                    const uint8_t byte = b[j >> 3];                                                 \
                    const uint8_t *at = below[byte];                                                \
                    for (int s = 0; s < 8; s++)                                                     \
                        o[j + s] = v[k + at[s]] & (T)(0 - (T)((byte >> s) & 1));                    \
                    k += __builtin_popcount(byte);                                                  \
                }                                                                                   \
            }                                                                                       \
            for (; j < cols; j++) {                                                                 \
                const int bit = (b[j >> 3] >> (j & 7)) & 1;                                         \
                o[j] = (bit && k < n) ? v[k] : (T)0;                                                \
                k += bit;                                                                           \
            }                                                                                       \
        }                                                                                           \
    }

DEFINE_DECOMPRESS(endor_decompress_8, uint8_t)
DEFINE_DECOMPRESS(endor_decompress_16, uint16_t)
DEFINE_DECOMPRESS(endor_decompress_32, uint32_t)
DEFINE_DECOMPRESS(endor_decompress_64, uint64_t)
