/* tqueue.wire._native_crc: the CRC-32C of many byte ranges of one buffer in one call
 * (tqueue/wire/_crc.py), for the per-sample checksums of tqueue/client/_integrity.py.
 *
 * crc_ranges(src, offsets, sizes, out) -> None
 *
 *   For each i, writes to out[i] (int64) the CRC-32C (Castagnoli, as the crc32c package and
 *   iSCSI compute it) of src[offsets[i] : offsets[i] + sizes[i]]; offsets, sizes and out are
 *   buffers of native int64 of one length. Every range is checked to lie inside src.
 *
 * hardware() -> bool: whether this CPU has the SSE4.2 CRC instruction; without it the module
 *   is not used (tqueue/wire/_crc.py calls the crc32c package once per range instead).
 *
 * Why C: a sample of a batch is 2-32 KB; calling the crc32c package once per sample costs
 * about 1.3 us a call beside the CRC itself, so 136 MB of 8-32 KB rows ran at 5-6 GB/s against
 * 13 GB/s for one call over the same bytes. Here the ranges are taken three at a time and their
 * CRC chains interleaved (the instruction's latency is three cycles, its throughput one), so
 * a pass runs at the memory's rate. The GIL is released during the pass.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define TQ_X86 1
#endif

#ifdef TQ_X86

__attribute__((target("sse4.2"))) static uint32_t
one(uint32_t crc, const unsigned char *p, int64_t n)
{
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n-- > 0)
        c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

/* three ranges at once: independent chains, so the instruction's latency is hidden */
__attribute__((target("sse4.2"))) static void
three(const unsigned char *a, const unsigned char *b, const unsigned char *c, int64_t na, int64_t nb, int64_t nc,
      int64_t *out)
{
    uint64_t ca = 0xFFFFFFFFu, cb = 0xFFFFFFFFu, cc = 0xFFFFFFFFu;
    int64_t common = na < nb ? na : nb;
    common = common < nc ? common : nc;
    common &= ~(int64_t)7;
    for (int64_t i = 0; i < common; i += 8) {
        uint64_t va, vb, vc;
        memcpy(&va, a + i, 8);
        memcpy(&vb, b + i, 8);
        memcpy(&vc, c + i, 8);
        ca = _mm_crc32_u64(ca, va);
        cb = _mm_crc32_u64(cb, vb);
        cc = _mm_crc32_u64(cc, vc);
    }
    out[0] = (int64_t)(~one((uint32_t)ca, a + common, na - common) & 0xFFFFFFFFu);
    out[1] = (int64_t)(~one((uint32_t)cb, b + common, nb - common) & 0xFFFFFFFFu);
    out[2] = (int64_t)(~one((uint32_t)cc, c + common, nc - common) & 0xFFFFFFFFu);
}

static void
ranges(const unsigned char *src, const int64_t *off, const int64_t *size, int64_t *out, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 3 <= n; i += 3)
        three(src + off[i], src + off[i + 1], src + off[i + 2], size[i], size[i + 1], size[i + 2], out + i);
    for (; i < n; i++)
        out[i] = (int64_t)(~one(0xFFFFFFFFu, src + off[i], size[i]) & 0xFFFFFFFFu);
}

static int
has_hardware(void)
{
    return __builtin_cpu_supports("sse4.2");
}

#else

static void
ranges(const unsigned char *src, const int64_t *off, const int64_t *size, int64_t *out, Py_ssize_t n)
{
    (void)src, (void)off, (void)size, (void)out, (void)n;
}

static int
has_hardware(void)
{
    return 0;
}

#endif

static PyObject *
crc_ranges(PyObject *self, PyObject *args)
{
    Py_buffer src, off, size, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &src, &off, &size, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = off.len / 8;
    if (!has_hardware()) {
        PyErr_SetString(PyExc_RuntimeError, "no SSE4.2 CRC instruction on this CPU");
        goto done;
    }
    if (off.len % 8 || size.len != off.len || out.len != off.len) {
        PyErr_SetString(PyExc_ValueError, "offsets, sizes and out must be int64 buffers of one length");
        goto done;
    }
    const int64_t *o = (const int64_t *)off.buf, *s = (const int64_t *)size.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] < 0 || s[i] < 0 || o[i] > src.len || s[i] > src.len - o[i]) {
            PyErr_Format(PyExc_ValueError, "range %zd [%lld, +%lld) lies outside the buffer of %zd bytes", i,
                         (long long)o[i], (long long)s[i], src.len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    ranges((const unsigned char *)src.buf, o, s, (int64_t *)out.buf, n);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&off);
    PyBuffer_Release(&size);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *
hardware(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(has_hardware());
}

static PyMethodDef methods[] = {
    {"crc_ranges", crc_ranges, METH_VARARGS, "CRC-32C of each range of a buffer into an int64 buffer."},
    {"hardware", hardware, METH_NOARGS, "Whether the CPU has the SSE4.2 CRC instruction."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_crc", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__native_crc(void)
{
    return PyModule_Create(&module);
}
