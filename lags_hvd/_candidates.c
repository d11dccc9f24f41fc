/* The candidate search of lags_hvd.selection.select_sampled, as one compiled pass.
 *
 *     count = find(keys, itemsize, threshold, out)
 *     count = add_find(a, b, sum, itemsize, threshold, out)
 *
 * keys: a C-contiguous buffer of signed integers of `itemsize` bytes (2, 4 or 8): the
 * bits of a float tensor. The magnitude of an entry is its key with the sign bit
 * cleared (integer order = order of |x|, NaN above +/-inf). Writes the ascending
 * positions i with magnitude(keys[i]) >= threshold into `out` (int64, writable), at
 * most len(out) of them, and returns how many there are in all: a count above
 * len(out) means `out` was too small and holds only the first ones.
 * add_find first writes sum = a + b (float32 or float64, each rounded as one IEEE
 * addition) and searches the sum's bits in the same loop: an accumulate and a
 * candidate search in one pass over memory.
 *
 * One read of the keys: each chunk of CHUNK entries is first tested as a whole, and
 * only a chunk holding a candidate is scanned again, from cache. The test ORs
 * threshold - 1 - magnitude over the chunk (negative iff magnitude >= threshold; no
 * overflow, as both are >= 0): subtractions and ORs only, which compilers vectorise
 * with the baseline instruction set. The GIL is released meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 64

/* On x86-64 an AVX2 clone too, chosen at load time where the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Per chunk: its sign-cleared keys are put in a small local array (L1), with zeros past
 * the end of a short last chunk; the chunk is tested as a whole, and only a chunk that
 * holds a hit is compacted (branch-free) into `out`. Loops of the fixed length CHUNK,
 * so the compiler unrolls and vectorises them without peeling. FILL(j) computes key j
 * of a full chunk starting at `start` (and for add_find writes the sum). */
#define DEFINE_SEARCH(NAME, PARAMS, TYPE, MASK, FILL)                                   \
    VECTOR_CLONES static Py_ssize_t NAME PARAMS                                         \
    {                                                                                   \
        Py_ssize_t count = 0;                                                           \
        TYPE keys[CHUNK];                                                               \
        int64_t hits[CHUNK];                                                            \
        for (Py_ssize_t start = 0; start < n; start += CHUNK) {                         \
            if (n - start >= CHUNK) {                                                   \
                for (int j = 0; j < CHUNK; j++)                                         \
                    keys[j] = (TYPE)((FILL(j)) & (MASK));                               \
            } else {                                                                    \
                for (int j = 0; j < CHUNK; j++)                                         \
                    keys[j] = start + j < n ? (TYPE)((FILL(j)) & (MASK)) : 0;           \
            }                                                                           \
            TYPE below = 0;  /* sign bit set iff some key >= threshold */               \
            for (int j = 0; j < CHUNK; j++)                                             \
                below |= (TYPE)(threshold - 1 - keys[j]);                               \
            if (below >= 0)                                                             \
                continue;                                                               \
            int found = 0;                                                              \
            for (int j = 0; j < CHUNK; j++) {                                           \
                hits[found] = start + j;                                                \
                found += keys[j] >= threshold;                                          \
            }                                                                           \
            if (start + found > n) /* padding (key 0) passes a threshold of 0 */        \
                found = (int)(n - start);                                               \
            for (int j = 0; j < found && count + j < capacity; j++)                     \
                out[count + j] = hits[j];                                               \
            count += found;                                                             \
        }                                                                               \
        return count;                                                                   \
    }

#define FIND_PARAMS(TYPE) (const TYPE *restrict source, Py_ssize_t n, TYPE threshold, int64_t *restrict out, \
                           Py_ssize_t capacity)
#define FIND_FILL(j) source[start + (j)]
DEFINE_SEARCH(find16, FIND_PARAMS(int16_t), int16_t, INT16_MAX, FIND_FILL)
DEFINE_SEARCH(find32, FIND_PARAMS(int32_t), int32_t, INT32_MAX, FIND_FILL)
DEFINE_SEARCH(find64, FIND_PARAMS(int64_t), int64_t, INT64_MAX, FIND_FILL)

/* sum[i] = a[i] + b[i], written, and its bits as the key (memcpy: no aliasing cast). */
#define ADD_PARAMS(FLOAT, TYPE) (const FLOAT *restrict a, const FLOAT *restrict b, FLOAT *restrict sum,       \
                                 Py_ssize_t n, TYPE threshold, int64_t *restrict out, Py_ssize_t capacity)
#define DEFINE_ADD_KEY(NAME, FLOAT, TYPE)                                               \
    static inline TYPE NAME(const FLOAT *restrict a, const FLOAT *restrict b, FLOAT *restrict sum, Py_ssize_t i) \
    {                                                                                   \
        FLOAT value = a[i] + b[i];                                                      \
        TYPE bits;                                                                      \
        sum[i] = value;                                                                 \
        memcpy(&bits, &value, sizeof bits);                                             \
        return bits;                                                                    \
    }
DEFINE_ADD_KEY(add_key32, float, int32_t)
DEFINE_ADD_KEY(add_key64, double, int64_t)
#define ADD_FILL32(j) add_key32(a, b, sum, start + (j))
#define ADD_FILL64(j) add_key64(a, b, sum, start + (j))
DEFINE_SEARCH(add_find32, ADD_PARAMS(float, int32_t), int32_t, INT32_MAX, ADD_FILL32)
DEFINE_SEARCH(add_find64, ADD_PARAMS(double, int64_t), int64_t, INT64_MAX, ADD_FILL64)

static int threshold_fits(long long threshold, int itemsize)
{
    return threshold >= 0 && (itemsize != 2 || threshold <= INT16_MAX) && (itemsize != 4 || threshold <= INT32_MAX);
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
        count = find16((const int16_t *)keys.buf, n, (int16_t)threshold, (int64_t *)out.buf, capacity);
        break;
    case 4:
        count = find32((const int32_t *)keys.buf, n, (int32_t)threshold, (int64_t *)out.buf, capacity);
        break;
    default:
        count = find64((const int64_t *)keys.buf, n, (int64_t)threshold, (int64_t *)out.buf, capacity);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(count);
}

static PyObject *add_find(PyObject *self, PyObject *args)
{
    Py_buffer a, b, sum, out;
    int itemsize;
    long long threshold;
    Py_ssize_t count = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*iLw*", &a, &b, &sum, &itemsize, &threshold, &out))
        return NULL;
    int bad_size = (itemsize != 4 && itemsize != 8) || a.len % itemsize || a.len != b.len || a.len != sum.len
                   || out.len % 8;
    if (bad_size || !threshold_fits(threshold, itemsize)) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&b);
        PyBuffer_Release(&sum);
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError,
                            bad_size ? "add_find: a, b and sum must hold the same whole %d-byte floats (4 or 8) "
                                       "and out whole int64"
                                     : "add_find: the threshold must be a magnitude key of %d bytes",
                            itemsize);
    }
    Py_ssize_t n = a.len / itemsize, capacity = out.len / 8;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 4)
        count = add_find32((const float *)a.buf, (const float *)b.buf, (float *)sum.buf, n, (int32_t)threshold,
                           (int64_t *)out.buf, capacity);
    else
        count = add_find64((const double *)a.buf, (const double *)b.buf, (double *)sum.buf, n, (int64_t)threshold,
                           (int64_t *)out.buf, capacity);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&sum);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS,
     "find(keys, itemsize, threshold, out) -> count: ascending positions with a sign-cleared key >= threshold"},
    {"add_find", add_find, METH_VARARGS,
     "add_find(a, b, sum, itemsize, threshold, out) -> count: sum = a + b (floats), then find on sum's bits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_candidates", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__candidates(void) { return PyModule_Create(&module); }
