/* lags_hvd's compiled passes over memory: the candidate search of lags_hvd.selection
 * (find, add_find, add_sample) and the zeroing of the merge target (zero, lags_hvd.arena).
 *
 *     count = find(keys, itemsize, threshold, out)
 *     count = add_find(a, parts, total, itemsize, threshold, out)
 *     m     = add_sample(a, parts, itemsize, stride, offset, sample)
 *     total = top_regions(keys, itemsize, boundaries, shares, out)
 *     zero(buffer)
 *
 * A key is the bits of a float as a signed integer of `itemsize` bytes (2, 4 or 8);
 * the magnitude of an entry is its key with the sign bit cleared (integer order =
 * order of |x|, NaN above +/-inf).
 *
 * find: `keys` a C-contiguous buffer of keys. Writes the ascending positions i with
 * magnitude(keys[i]) >= threshold into `out` (int64, writable), at most len(out) of
 * them, and returns how many there are in all: a count above len(out) means `out`
 * was too small and holds only the first ones.
 *
 * add_find: `parts` a sequence of float buffers (float32 or float64) that make up `b`
 * end to end (a bucket's gradients). Writes total = a + b (each entry rounded as one
 * IEEE addition; `total` may not overlap the inputs) and finds, as `find` on total's
 * keys, in the same loop: an accumulate and a candidate search in one pass over
 * memory. A total of STREAM_BYTES or more is written with non-temporal stores (on
 * x86-64), past the caches: it is read again only at a few positions before the next
 * iteration, and an ordinary store would first read every line it writes.
 *
 * add_sample: the magnitudes of a + b at the positions offset, offset + stride, ...
 * (0 <= offset < stride) into `sample` (int32 or int64 as the floats), at most
 * len(sample) of them, returning how many.
 *
 * zero: every byte of a writable C-contiguous `buffer` set to 0; from STREAM_BYTES on,
 * with non-temporal stores from its first cache line (on x86-64): the merge scatters
 * a few entries into it and the optimizer's step reads it once.
 *
 * The search: per chunk of CHUNK entries, the magnitudes go into a small local array;
 * the chunk is tested as a whole by ORing threshold - 1 - magnitude (negative iff
 * magnitude >= threshold; no overflow, as both are >= 0), subtractions and ORs the
 * compiler vectorises; only a chunk that holds a hit is compacted, branch-free, from
 * that array, and within it only the blocks of SUB entries that hold one (at a density
 * of 1% most chunks hold a hit, few blocks do). The GIL is released while the loops run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>   /* SSE2, in every x86-64: _mm_stream_si128, _mm_sfence */
#endif

#define CHUNK 64
#define SUB 8   /* a chunk with a hit is compacted block by block, skipping blocks without one */
#define LINE 64 /* bytes per cache line: a streamed total starts on one */
#define STREAM_BYTES (1 << 20)   /* from here on (a core's L2 and more) add_find and zero stream their output */

/* On x86-64 an AVX2 clone too, chosen at load time where the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Search n entries whose bits j (of a full chunk starting at `start`) FILL(j)
 * computes, writing positions base + i; loops of the fixed length CHUNK, so the
 * compiler unrolls and vectorises them without peeling (a short last chunk is padded
 * with magnitude 0). STORE(start, bits, count) is then handed the chunk's bits. */
#define DEFINE_SEARCH(NAME, PARAMS, TYPE, MASK, FILL, STORE)                            \
    VECTOR_CLONES static Py_ssize_t NAME PARAMS                                         \
    {                                                                                   \
        Py_ssize_t count = 0;                                                           \
        TYPE bits[CHUNK], keys[CHUNK];                                                  \
        int64_t hits[CHUNK];                                                            \
        for (Py_ssize_t start = 0; start < n; start += CHUNK) {                         \
            if (n - start >= CHUNK) {                                                   \
                for (int j = 0; j < CHUNK; j++) {                                       \
                    bits[j] = FILL(j);                                                  \
                    keys[j] = (TYPE)(bits[j] & (MASK));                                 \
                }                                                                       \
                STORE(start, bits, CHUNK);                                              \
            } else {                                                                    \
                for (int j = 0; j < CHUNK; j++) {                                       \
                    bits[j] = start + j < n ? FILL(j) : 0;                              \
                    keys[j] = (TYPE)(bits[j] & (MASK));                                 \
                }                                                                       \
                STORE(start, bits, (int)(n - start));                                   \
            }                                                                           \
            TYPE below = 0;  /* sign bit set iff some magnitude >= threshold */         \
            for (int j = 0; j < CHUNK; j++)                                             \
                below |= (TYPE)(threshold - 1 - keys[j]);                               \
            if (below >= 0)                                                             \
                continue;                                                               \
            int found = 0;   /* the same test per block of SUB, then compaction */      \
            for (int s = 0; s < CHUNK; s += SUB) {                                      \
                TYPE block_below = 0;                                                   \
                for (int j = s; j < s + SUB; j++)                                       \
                    block_below |= (TYPE)(threshold - 1 - keys[j]);                     \
                if (block_below >= 0)                                                   \
                    continue;                                                           \
                for (int j = s; j < s + SUB; j++) {                                     \
                    hits[found] = base + start + j;                                     \
                    found += keys[j] >= threshold;                                      \
                }                                                                       \
            }                                                                           \
            if (start + found > n) /* padding (magnitude 0) passes a threshold of 0 */  \
                found = (int)(n - start);                                               \
            for (int j = 0; j < found && count + j < capacity; j++)                     \
                out[count + j] = hits[j];                                               \
            count += found;                                                             \
        }                                                                               \
        return count;                                                                   \
    }

#define FIND_PARAMS(TYPE) (const TYPE *restrict source, Py_ssize_t n, TYPE threshold, Py_ssize_t base,         \
                           int64_t *restrict out, Py_ssize_t capacity)
#define FIND_FILL(j) source[start + (j)]
#define FIND_STORE(start, bits, count) /* find writes nothing */
DEFINE_SEARCH(find16, FIND_PARAMS(int16_t), int16_t, INT16_MAX, FIND_FILL, FIND_STORE)
DEFINE_SEARCH(find32, FIND_PARAMS(int32_t), int32_t, INT32_MAX, FIND_FILL, FIND_STORE)
DEFINE_SEARCH(find64, FIND_PARAMS(int64_t), int64_t, INT64_MAX, FIND_FILL, FIND_STORE)

/* The bits of a[i] + b[i] (memcpy: no aliasing cast). */
#define DEFINE_ADD_BITS(NAME, FLOAT, TYPE)                                              \
    static inline TYPE NAME(const FLOAT *restrict a, const FLOAT *restrict b, Py_ssize_t i) \
    {                                                                                   \
        FLOAT value = a[i] + b[i];                                                      \
        TYPE bits;                                                                      \
        memcpy(&bits, &value, sizeof bits);                                             \
        return bits;                                                                    \
    }
DEFINE_ADD_BITS(add_bits32, float, int32_t)
DEFINE_ADD_BITS(add_bits64, double, int64_t)

/* Bytes from p to the start of the next cache line (0 when p starts one). */
static inline size_t to_next_line(const void *p) { return (LINE - (uintptr_t)p % LINE) % LINE; }

/* Write `bytes` bytes to `to`: with non-temporal stores where `stream` is set and `to`
 * starts on a cache line (only a whole chunk's bytes then, a multiple of 16), else as
 * memcpy does. */
static inline void store_bytes(char *restrict to, const void *restrict from, size_t bytes, int stream)
{
#if defined(__x86_64__)
    if (stream && to_next_line(to) == 0 && bytes % 16 == 0) {
        for (size_t i = 0; i < bytes; i += 16)
            _mm_stream_si128((__m128i *)(to + i), _mm_loadu_si128((const __m128i *)((const char *)from + i)));
        return;
    }
#endif
    (void)stream;
    memcpy(to, from, bytes);
}

#define ADD_PARAMS(FLOAT, TYPE) (const FLOAT *restrict a, const FLOAT *restrict b, FLOAT *restrict total,     \
                                 int stream, Py_ssize_t n, TYPE threshold, Py_ssize_t base,                    \
                                 int64_t *restrict out, Py_ssize_t capacity)
#define ADD_FILL32(j) add_bits32(a, b, start + (j))
#define ADD_FILL64(j) add_bits64(a, b, start + (j))
#define ADD_STORE(start, bits, count) store_bytes((char *)(total + (start)), bits, (size_t)(count) * sizeof *total, stream)
DEFINE_SEARCH(add_find32, ADD_PARAMS(float, int32_t), int32_t, INT32_MAX, ADD_FILL32, ADD_STORE)
DEFINE_SEARCH(add_find64, ADD_PARAMS(double, int64_t), int64_t, INT64_MAX, ADD_FILL64, ADD_STORE)

static int threshold_fits(long long threshold, int itemsize)
{
    return threshold >= 0 && (itemsize != 2 || threshold <= INT16_MAX) && (itemsize != 4 || threshold <= INT32_MAX);
}

/* The buffers of `parts` (contiguous, whole floats of itemsize bytes, totalling
 * `expected` bytes) into a new array; NULL with an exception set otherwise. */
static Py_buffer *get_parts(PyObject *parts, int itemsize, Py_ssize_t expected, Py_ssize_t *count)
{
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), got = 0, bytes = 0;
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_SIMPLE) < 0)
            break;
        bytes += views[got].len;
        if (views[got].len % itemsize) {
            got++;
            PyErr_Format(PyExc_ValueError, "a part is not whole %d-byte floats", itemsize);
            break;
        }
    }
    Py_DECREF(seq);
    if (!PyErr_Occurred() && bytes != expected)
        PyErr_Format(PyExc_ValueError, "the parts hold %zd bytes, a holds %zd: they must be the same size", bytes,
                     expected);
    if (PyErr_Occurred()) {
        for (Py_ssize_t i = 0; i < got; i++)
            PyBuffer_Release(&views[i]);
        PyMem_Free(views);
        return NULL;
    }
    *count = n;
    return views;
}

static int overlaps(const Py_buffer *x, const Py_buffer *y)
{
    const char *x0 = x->buf, *y0 = y->buf;
    return x->len > 0 && y->len > 0 && x0 < y0 + y->len && y0 < x0 + x->len;
}

static int any_overlaps(const Py_buffer *x, const Py_buffer *views, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (overlaps(x, &views[i]))
            return 1;
    return 0;
}

static void release_parts(Py_buffer *views, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

static PyObject *find(PyObject *self, PyObject *args)
{
    Py_buffer keys, out;
    int itemsize;
    long long threshold;
    Py_ssize_t count = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iLw*", &keys, &itemsize, &threshold, &out))
        return NULL;
    int bad_size = (itemsize != 2 && itemsize != 4 && itemsize != 8) || keys.len % itemsize || out.len % 8;
    if (bad_size || !threshold_fits(threshold, itemsize)) {
        PyBuffer_Release(&keys);
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError,
                            bad_size ? "find: keys must hold whole %d-byte integers (2, 4 or 8) and out whole int64"
                                     : "find: the threshold must be a magnitude key of %d bytes",
                            itemsize);
    }
    Py_ssize_t n = keys.len / itemsize, capacity = out.len / 8;
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 2:
        count = find16((const int16_t *)keys.buf, n, (int16_t)threshold, 0, (int64_t *)out.buf, capacity);
        break;
    case 4:
        count = find32((const int32_t *)keys.buf, n, (int32_t)threshold, 0, (int64_t *)out.buf, capacity);
        break;
    default:
        count = find64((const int64_t *)keys.buf, n, (int64_t)threshold, 0, (int64_t *)out.buf, capacity);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(count);
}

static PyObject *add_find(PyObject *self, PyObject *args)
{
    Py_buffer a, total, out;
    PyObject *parts;
    int itemsize;
    long long threshold;
    Py_ssize_t count = 0, nparts = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*Ow*iLw*", &a, &parts, &total, &itemsize, &threshold, &out))
        return NULL;
    Py_buffer *views = NULL;
    int bad_size = (itemsize != 4 && itemsize != 8) || a.len % itemsize || a.len != total.len || out.len % 8;
    if (bad_size || !threshold_fits(threshold, itemsize))
        PyErr_Format(PyExc_ValueError,
                     bad_size ? "add_find: a and total must hold the same whole %d-byte floats (4 or 8) "
                                "and out whole int64"
                              : "add_find: the threshold must be a magnitude key of %d bytes",
                     itemsize);
    else
        views = get_parts(parts, itemsize, a.len, &nparts);
    if (views != NULL && (overlaps(&total, &a) || overlaps(&total, &out) || any_overlaps(&total, views, nparts))) {
        PyErr_SetString(PyExc_ValueError, "add_find: total must not overlap a, a part or out (it is written while "
                                          "they are read)");
        release_parts(views, nparts);
        views = NULL;
    }
    if (views != NULL) {
        Py_ssize_t capacity = out.len / 8, start = 0;
        int64_t *positions = (int64_t *)out.buf;
        int stream = total.len >= STREAM_BYTES;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t p = 0; p < nparts; p++) {
            const char *b = views[p].buf;
            Py_ssize_t left = views[p].len / itemsize;
            while (left > 0) {   /* streamed: a head up to total's next cache line, then the rest */
                Py_ssize_t head = (Py_ssize_t)to_next_line((char *)total.buf + start * itemsize);
                Py_ssize_t n = stream && head && head % itemsize == 0 ? head / itemsize : left;
                Py_ssize_t room = count < capacity ? capacity - count : 0;
                int64_t *at = positions + (count < capacity ? count : capacity);
                n = n < left ? n : left;
                if (itemsize == 4)
                    count += add_find32((const float *)a.buf + start, (const float *)b, (float *)total.buf + start,
                                        stream, n, (int32_t)threshold, start, at, room);
                else
                    count += add_find64((const double *)a.buf + start, (const double *)b, (double *)total.buf + start,
                                        stream, n, (int64_t)threshold, start, at, room);
                b += n * itemsize;
                start += n;
                left -= n;
            }
        }
#if defined(__x86_64__)
        _mm_sfence();   /* the streamed stores ordered before anything after this call */
#endif
        Py_END_ALLOW_THREADS
        release_parts(views, nparts);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&total);
    PyBuffer_Release(&out);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(count);
}

#define DEFINE_SAMPLE(NAME, FLOAT, TYPE, MASK)                                          \
    static Py_ssize_t NAME(const FLOAT *a, const Py_buffer *views, Py_ssize_t nparts, Py_ssize_t stride, \
                           Py_ssize_t offset, TYPE *sample, Py_ssize_t capacity)       \
    {                                                                                   \
        Py_ssize_t m = 0, start = 0;                                                    \
        for (Py_ssize_t p = 0; p < nparts; p++) {                                       \
            const FLOAT *b = (const FLOAT *)views[p].buf;                               \
            Py_ssize_t n = views[p].len / (Py_ssize_t)sizeof(FLOAT);                    \
            Py_ssize_t i = (offset - start) % stride; /* no overflow: 0 <= offset < stride */ \
            if (i < 0)                                                                  \
                i += stride;                                                            \
            for (; i < n && m < capacity; i = stride > n - i ? n : i + stride) {        \
                FLOAT value = a[start + i] + b[i];                                      \
                TYPE bits;                                                              \
                memcpy(&bits, &value, sizeof bits);                                     \
                sample[m++] = bits & (MASK);                                            \
            }                                                                           \
            start += n;                                                                 \
        }                                                                               \
        return m;                                                                       \
    }
DEFINE_SAMPLE(add_sample32, float, int32_t, INT32_MAX)
DEFINE_SAMPLE(add_sample64, double, int64_t, INT64_MAX)

static PyObject *add_sample(PyObject *self, PyObject *args)
{
    Py_buffer a, sample;
    PyObject *parts;
    int itemsize;
    Py_ssize_t stride, offset, m = 0, nparts = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*Oinnw*", &a, &parts, &itemsize, &stride, &offset, &sample))
        return NULL;
    Py_buffer *views = NULL;
    if ((itemsize != 4 && itemsize != 8) || a.len % itemsize || sample.len % itemsize || stride < 1 || offset < 0
        || offset >= stride)
        PyErr_Format(PyExc_ValueError, "add_sample: a and sample must hold whole %d-byte floats and keys (4 or 8), "
                                       "and 0 <= offset < stride", itemsize);
    else
        views = get_parts(parts, itemsize, a.len, &nparts);
    if (views != NULL) {
        Py_ssize_t capacity = sample.len / itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 4)
            m = add_sample32((const float *)a.buf, views, nparts, stride, offset, (int32_t *)sample.buf, capacity);
        else
            m = add_sample64((const double *)a.buf, views, nparts, stride, offset, (int64_t *)sample.buf, capacity);
        Py_END_ALLOW_THREADS
        release_parts(views, nparts);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&sample);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(m);
}

/* top_regions: the exact top-shares[r] magnitudes of every region r = [boundaries[r],
 * boundaries[r+1]) of the keys in one pass over them, each region's positions written in
 * ascending order, regions one after another. Per region the chosen entries are a binary
 * heap with the weakest (the lowest magnitude, the latest position among equals) at its
 * root; a chunk of CHUNK keys is tested as a whole against it (as in the search), and only
 * a key strictly above it enters, in the root's place: so ties go to the lowest positions.
 * Cost: one pass, plus about share * ln(length / share) heap updates per region. */
#define TOP_SHARE_MAX (1 << 20)
static inline int weaker(int64_t key_a, int64_t pos_a, int64_t key_b, int64_t pos_b)
{
    return key_a < key_b || (key_a == key_b && pos_a > pos_b);
}

static int ascending(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

#define DEFINE_TOP_REGIONS(NAME, TYPE, MASK)                                            \
    VECTOR_CLONES static void NAME(const TYPE *restrict source, const int64_t *bounds,  \
                                   const int64_t *shares, Py_ssize_t regions,           \
                                   int64_t *restrict out, int64_t *restrict heap)       \
    {                                                                                   \
        for (Py_ssize_t r = 0; r < regions; r++) {                                      \
            int64_t begin = bounds[r], end = bounds[r + 1], share = shares[r], held = 0; \
            TYPE floor = -1; /* the root's magnitude once the share is full */         \
            for (int64_t start = begin; start < end && share; start += CHUNK) {         \
                int64_t stop = end - start < CHUNK ? end - start : CHUNK;               \
                TYPE keys[CHUNK], above = 0;                                            \
                if (stop == CHUNK) /* a full chunk: fixed-length loops, vectorised */  \
                    for (int j = 0; j < CHUNK; j++)                                     \
                        keys[j] = (TYPE)(source[start + j] & (MASK));                   \
                else                                                                    \
                    for (int j = 0; j < CHUNK; j++)                                     \
                        keys[j] = j < stop ? (TYPE)(source[start + j] & (MASK)) : -1;   \
                for (int j = 0; j < CHUNK; j++)                                         \
                    above |= (TYPE)(floor - keys[j]);                                   \
                if (above >= 0)                                                         \
                    continue;                                                           \
                for (int j = 0; j < stop; j++) {                                        \
                    int64_t key = keys[j], position = start + j, at;                    \
                    if (key <= floor)                                                   \
                        continue;                                                       \
                    if (held < share) { /* sift up from a new leaf */                   \
                        for (at = held++; at > 0; at = (at - 1) / 2) {                  \
                            int64_t up = (at - 1) / 2;                                  \
                            if (!weaker(key, position, heap[up], out[up]))          \
                                break;                                                  \
                            heap[at] = heap[up];                                \
                            out[at] = out[up];                                          \
                        }                                                               \
                    } else {            /* replace the root, sift down */              \
                        for (at = 0;;) {                                                \
                            int64_t child = 2 * at + 1;                                 \
                            if (child >= share)                                         \
                                break;                                                  \
                            if (child + 1 < share                                       \
                                && weaker(heap[child + 1], out[child + 1], heap[child], out[child])) \
                                child++;                                                \
                            if (!weaker(heap[child], out[child], key, position))    \
                                break;                                                  \
                            heap[at] = heap[child];                             \
                            out[at] = out[child];                                       \
                            at = child;                                                 \
                        }                                                               \
                    }                                                                   \
                    heap[at] = key;                                                 \
                    out[at] = position;                                                 \
                    if (held == share)                                                  \
                        floor = (TYPE)heap[0];                                          \
                }                                                                       \
            }                                                                           \
            qsort(out, (size_t)held, sizeof(int64_t), ascending);                       \
            out += held;                                                                \
        }                                                                               \
    }
DEFINE_TOP_REGIONS(top_regions16, int16_t, INT16_MAX)
DEFINE_TOP_REGIONS(top_regions32, int32_t, INT32_MAX)
DEFINE_TOP_REGIONS(top_regions64, int64_t, INT64_MAX)

static PyObject *top_regions(PyObject *self, PyObject *args)
{
    Py_buffer keys, bounds, shares, out;
    int itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*", &keys, &itemsize, &bounds, &shares, &out))
        return NULL;
    Py_ssize_t regions = shares.len / 8, n = itemsize > 0 ? keys.len / itemsize : 0, total = 0;
    const int64_t *b = bounds.buf, *k = shares.buf;
    int bad = (itemsize != 2 && itemsize != 4 && itemsize != 8) || keys.len % itemsize || shares.len % 8
              || bounds.len != (regions + 1) * 8 || out.len % 8;
    for (Py_ssize_t r = 0; !bad && r < regions; r++) {
        bad = b[r] < 0 || b[r] > b[r + 1] || b[r + 1] > n || k[r] < 0 || k[r] > b[r + 1] - b[r] || k[r] > TOP_SHARE_MAX;
        total += k[r];
    }
    int64_t largest = 0;
    for (Py_ssize_t r = 0; !bad && r < regions; r++)
        largest = k[r] > largest ? k[r] : largest;
    void *keep = bad || total * 8 != out.len ? NULL : PyMem_Malloc((size_t)(largest + 1) * 8);
    if (keep != NULL) {
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 2)
            top_regions16(keys.buf, b, k, regions, out.buf, keep);
        else if (itemsize == 4)
            top_regions32(keys.buf, b, k, regions, out.buf, keep);
        else
            top_regions64(keys.buf, b, k, regions, out.buf, keep);
        Py_END_ALLOW_THREADS
        PyMem_Free(keep);
    } else if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "top_regions: keys of %d bytes, int64 boundaries (regions + 1) and shares "
                                       "(each within its region and at most %d), out of sum(shares) int64",
                     itemsize, TOP_SHARE_MAX);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&shares);
    PyBuffer_Release(&out);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(total);
}

static PyObject *zero(PyObject *self, PyObject *args)
{
    Py_buffer buffer;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*", &buffer))
        return NULL;
    char *to = buffer.buf;
    size_t bytes = (size_t)buffer.len;
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__)
    if (bytes >= STREAM_BYTES) {
        size_t head = to_next_line(to), body = (bytes - head) / LINE * LINE;
        __m128i zeros = _mm_setzero_si128();
        memset(to, 0, head);
        for (size_t i = head; i < head + body; i += 16)
            _mm_stream_si128((__m128i *)(to + i), zeros);
        memset(to + head + body, 0, bytes - head - body);
        _mm_sfence();
    } else
#endif
        memset(to, 0, bytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buffer);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS,
     "find(keys, itemsize, threshold, out) -> count: ascending positions with magnitude >= threshold"},
    {"add_find", add_find, METH_VARARGS,
     "add_find(a, parts, total, itemsize, threshold, out) -> count: total = a + parts end to end, then find"},
    {"add_sample", add_sample, METH_VARARGS,
     "add_sample(a, parts, itemsize, stride, offset, sample) -> m: magnitudes of a + b every stride-th entry"},
    {"top_regions", top_regions, METH_VARARGS,
     "top_regions(keys, itemsize, boundaries, shares, out) -> total: every region's top-share positions"},
    {"zero", zero, METH_VARARGS, "zero(buffer): every byte 0 (streamed past the caches from 1 MiB on)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
