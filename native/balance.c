/* tqueue._native_balance: the hot inner routines of tqueue/controller/_balance.py in C.
 *
 * Each function here returns exactly what its Python twin in _balance.py returns for the same
 * arguments (same lists, same order inside them, same tie-breaking), so the planner gives the
 * identical plan with or without this module. Argument checking and the public API stay in
 * Python; these functions trust their callers (_balance.py) and only guard against what would
 * crash or silently differ:
 *
 *   - ``vals`` must be a list of ints and every position must index it (else TypeError or
 *     IndexError);
 *   - every length read, and every token total the routine can form, must fit in int64 and be
 *     non-negative; otherwise OverflowError, on which _balance.py runs the Python version
 *     (Python ints are unbounded, C's are not).
 *
 * Sorting is stable everywhere, as Python's is, so even inputs whose sort keys tie give the
 * Python result.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* reading lengths */

/* vals[p] for the position object ``pos`` as an int64 in [0, INT64_MAX]; -1 with an exception
 * set on error. The position's index into ``vals`` goes to *index when index is not NULL. */
static int
read_len(PyObject *vals, PyObject *pos, int64_t *out, Py_ssize_t *index)
{
    Py_ssize_t p = PyLong_AsSsize_t(pos);
    if (p == -1 && PyErr_Occurred())
        return -1;
    if (p < 0 || p >= PyList_GET_SIZE(vals)) {
        PyErr_Format(PyExc_IndexError, "position %zd is outside the %zd lengths", p,
                     PyList_GET_SIZE(vals));
        return -1;
    }
    PyObject *item = PyList_GET_ITEM(vals, p);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "lengths[%zd] is not an int", p);
        return -1;
    }
    long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred())
        return -1; /* OverflowError: the caller falls back to Python */
    if (v < 0) {
        PyErr_SetString(PyExc_OverflowError, "negative length: left to the Python version");
        return -1;
    }
    *out = (int64_t)v;
    if (index)
        *index = p;
    return 0;
}

/* total += v, or OverflowError if the total would leave int64. */
static int
add_total(int64_t *total, int64_t v)
{
    if (v > INT64_MAX - *total) {
        PyErr_SetString(PyExc_OverflowError,
                        "token total beyond int64: left to the Python version");
        return -1;
    }
    *total += v;
    return 0;
}

static int
check_list(PyObject *vals)
{
    if (!PyList_Check(vals)) {
        PyErr_SetString(PyExc_TypeError, "vals must be a list of ints");
        return -1;
    }
    return 0;
}

/* A stable merge sort of a[0..n) by LESS(x, y) (pointers to two elements), tmp with room for
 * n / 2: insertion sort below 17 elements, else both halves sorted and merged, ties to the left.
 * Stable sorts agree on every input, so each gives what Python's sort gives for the same keys. */
#define DEFINE_STABLE_SORT(NAME, T, LESS)                                                    \
    static void NAME(T *a, Py_ssize_t n, T *tmp)                                             \
    {                                                                                        \
        if (n <= 16) {                                                                       \
            for (Py_ssize_t i = 1; i < n; i++) {                                             \
                T s = a[i];                                                                  \
                Py_ssize_t j = i;                                                            \
                while (j > 0 && LESS(&s, &a[j - 1])) {                                       \
                    a[j] = a[j - 1];                                                         \
                    j--;                                                                     \
                }                                                                            \
                a[j] = s;                                                                    \
            }                                                                                \
            return;                                                                          \
        }                                                                                    \
        Py_ssize_t half = n / 2;                                                             \
        NAME(a, half, tmp);                                                                  \
        NAME(a + half, n - half, tmp);                                                       \
        if (!LESS(&a[half], &a[half - 1]))                                                   \
            return; /* already in order */                                                   \
        memcpy(tmp, a, (size_t)half * sizeof(T));                                            \
        Py_ssize_t i = 0, j = half, o = 0; /* o < j: writing never overtakes reading */      \
        while (i < half && j < n) {                                                          \
            if (LESS(&a[j], &tmp[i]))                                                        \
                a[o++] = a[j++];                                                             \
            else                                                                             \
                a[o++] = tmp[i++];                                                           \
        }                                                                                    \
        while (i < half)                                                                     \
            a[o++] = tmp[i++];                                                               \
    }

/* ------------------------------------------------------------------------------------------ */
/* Karmarkar-Karp */

/* One non-empty subset of a partial solution: Python's (sum, count, uid, tree). Its items form
 * a linked list through next[] (indices into ``order``) in the order _flatten yields them. */
typedef struct {
    int64_t sum;
    int64_t count;
    int64_t uid;
    Py_ssize_t head;
    Py_ssize_t tail;
} Subset;

/* A partial solution: its non-empty subsets sorted ascending, heap key (-spread, seq). */
typedef struct {
    int64_t key;
    int64_t seq;
    Subset *subs;
    Py_ssize_t len;
} Sol;

/* Python compares the tuples (sum, count, uid, tree); uids are distinct except for one
 * position given twice, whose tuples are then equal: stable sorts keep them as Python does. */
static inline int
subset_lt(const Subset *x, const Subset *y)
{
    if (x->sum != y->sum)
        return x->sum < y->sum;
    if (x->count != y->count)
        return x->count < y->count;
    return x->uid < y->uid;
}

/* Stable merge of the sorted runs x[0..nx) and y[0..ny) into out; ties take x first. */
static void
merge_runs(const Subset *x, Py_ssize_t nx, const Subset *y, Py_ssize_t ny, Subset *out)
{
    Py_ssize_t i = 0, j = 0, o = 0;
    while (i < nx && j < ny) {
        if (subset_lt(&y[j], &x[i]))
            out[o++] = y[j++];
        else
            out[o++] = x[i++];
    }
    while (i < nx)
        out[o++] = x[i++];
    while (j < ny)
        out[o++] = y[j++];
}

/* Stable merge of three sorted runs into out; ties take x, then y, then z. */
static void
merge3_runs(const Subset *x, Py_ssize_t nx, const Subset *y, Py_ssize_t ny, const Subset *z,
            Py_ssize_t nz, Subset *out)
{
    Py_ssize_t i = 0, j = 0, l = 0, o = 0;
    while (i < nx && j < ny && l < nz) {
        if (subset_lt(&y[j], &x[i])) {
            if (subset_lt(&z[l], &y[j]))
                out[o++] = z[l++];
            else
                out[o++] = y[j++];
        }
        else if (subset_lt(&z[l], &x[i]))
            out[o++] = z[l++];
        else
            out[o++] = x[i++];
    }
    if (i == nx)
        merge_runs(y + j, ny - j, z + l, nz - l, out + o);
    else if (j == ny)
        merge_runs(x + i, nx - i, z + l, nz - l, out + o);
    else
        merge_runs(x + i, nx - i, y + j, ny - j, out + o);
}

/* sort_subsets(a, n, tmp): ascending, stable; tmp has room for n / 2. */
DEFINE_STABLE_SORT(sort_subsets, Subset, subset_lt)

static inline int
sol_lt(const Sol *x, const Sol *y)
{
    if (x->key != y->key)
        return x->key < y->key;
    return x->seq < y->seq;
}

static void
heap_down(Sol *heap, Py_ssize_t n, Py_ssize_t i)
{
    Sol item = heap[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && sol_lt(&heap[c + 1], &heap[c]))
            c++;
        if (!sol_lt(&heap[c], &item))
            break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = item;
}

static void
heap_up(Sol *heap, Py_ssize_t i)
{
    Sol item = heap[i];
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!sol_lt(&item, &heap[parent]))
            break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = item;
}

static Sol
heap_pop(Sol *heap, Py_ssize_t *n)
{
    Sol top = heap[0];
    (*n)--;
    if (*n > 0) {
        heap[0] = heap[*n];
        heap_down(heap, *n, 0);
    }
    return top;
}

/* A new list of the subset's items, as _flatten orders them. */
static PyObject *
subset_items(const Subset *s, const Py_ssize_t *next, PyObject **order_items)
{
    PyObject *out = PyList_New((Py_ssize_t)s->count);
    if (!out)
        return NULL;
    Py_ssize_t i = s->head;
    for (Py_ssize_t o = 0; o < (Py_ssize_t)s->count; o++) {
        PyObject *p = order_items[i];
        Py_INCREF(p);
        PyList_SET_ITEM(out, o, p);
        i = next[i];
    }
    return out;
}

PyDoc_STRVAR(kk_doc,
"kk(vals, order, parts, equal_size) -> list of parts lists\n\n"
"_balance._kk: k-way largest differencing over the positions ``order``.");

static PyObject *
native_kk(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *vals, *order_arg;
    Py_ssize_t k;
    int equal_size;
    if (!PyArg_ParseTuple(args, "OOnp:kk", &vals, &order_arg, &k, &equal_size))
        return NULL;
    if (check_list(vals) < 0)
        return NULL;
    if (k < 1) {
        PyErr_SetString(PyExc_ValueError, "parts must be >= 1");
        return NULL;
    }
    PyObject *order = PySequence_Fast(order_arg, "order must be a sequence of positions");
    if (!order)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(order);
    PyObject **items = PySequence_Fast_ITEMS(order);
    PyObject *result = NULL;

    if (k == 1) {
        PyObject *all = PyList_New(n);
        if (!all)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_INCREF(items[i]);
            PyList_SET_ITEM(all, i, items[i]);
        }
        result = PyList_New(1);
        if (!result) {
            Py_DECREF(all);
            goto done;
        }
        PyList_SET_ITEM(result, 0, all);
        goto done;
    }
    if (n == 0) {
        result = PyList_New(k);
        if (!result)
            goto done;
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *empty = PyList_New(0);
            if (!empty) {
                Py_CLEAR(result);
                goto done;
            }
            PyList_SET_ITEM(result, i, empty);
        }
        goto done;
    }

    Py_ssize_t *next = PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    Sol *heap = PyMem_Malloc((size_t)n * sizeof(Sol)); /* never more solutions than items */
    /* a solution holds at most min(k, n) non-empty subsets */
    Py_ssize_t room = k < n ? k : n;
    Subset *tmp = PyMem_Malloc((size_t)(room + 1) * sizeof(Subset));
    Subset *fresh = PyMem_Malloc((size_t)(room + 1) * sizeof(Subset));
    Py_ssize_t nheap = 0;
    if (!next || !heap || !tmp || !fresh) {
        PyErr_NoMemory();
        goto cleanup;
    }

    /* Seeds: positions as uids, as Python's (vals[p], 1, p, p). */
    int64_t total = 0;
    Py_ssize_t group = equal_size ? k : 1;
    for (Py_ssize_t g = 0; g < n; g += group) {
        Py_ssize_t len = n - g < group ? n - g : group;
        Subset *subs = PyMem_Malloc((size_t)len * sizeof(Subset));
        if (!subs) {
            PyErr_NoMemory();
            goto cleanup;
        }
        heap[nheap].subs = subs;
        heap[nheap].len = len;
        heap[nheap].seq = nheap;
        nheap++;
        for (Py_ssize_t j = 0; j < len; j++) {
            int64_t v;
            Py_ssize_t p;
            if (read_len(vals, items[g + j], &v, &p) < 0 || add_total(&total, v) < 0)
                goto cleanup;
            subs[j].sum = v;
            subs[j].count = 1;
            subs[j].uid = p;
            subs[j].head = subs[j].tail = g + j;
            next[g + j] = -1;
        }
        if (equal_size) {
            sort_subsets(subs, len, tmp);
            heap[nheap - 1].key = subs[0].sum - subs[len - 1].sum;
        }
        else {
            heap[nheap - 1].key = -subs[0].sum;
        }
    }
    for (Py_ssize_t i = nheap / 2 - 1; i >= 0; i--)
        heap_down(heap, nheap, i);

    int64_t seq = nheap;
    int64_t uid = PyList_GET_SIZE(vals);
    while (nheap > 1) {
        Sol a = heap_pop(heap, &nheap);
        Sol b = heap_pop(heap, &nheap); /* both now owned here, out of the heap */
        Py_ssize_t m = a.len + b.len - k;
        Py_ssize_t len = m <= 0 ? a.len + b.len : k;
        Subset *merged = PyMem_Malloc((size_t)len * sizeof(Subset));
        if (!merged) {
            PyMem_Free(a.subs);
            PyMem_Free(b.subs);
            PyErr_NoMemory();
            goto cleanup;
        }
        if (m <= 0) {
            merge_runs(a.subs, a.len, b.subs, b.len, merged);
        }
        else {
            /* a[i] pairs with b[m-1-i]; the joined items read as _flatten((ta, tb)) does:
             * b's items, then a's. */
            for (Py_ssize_t i = 0; i < m; i++) {
                const Subset *x = &a.subs[i], *y = &b.subs[m - 1 - i];
                fresh[i].sum = x->sum + y->sum;
                fresh[i].count = x->count + y->count;
                fresh[i].uid = uid++;
                fresh[i].head = y->head;
                next[y->tail] = x->head;
                fresh[i].tail = x->tail;
            }
            sort_subsets(fresh, m, tmp);
            /* Python sorts a[m:] + b[m:] + fresh stably: the same as merging the three
             * sorted runs with ties to the earlier run. */
            merge3_runs(a.subs + m, a.len - m, b.subs + m, b.len - m, fresh, m, merged);
        }
        PyMem_Free(a.subs);
        PyMem_Free(b.subs);
        int64_t low = len == k ? merged[0].sum : 0;
        heap[nheap].key = low - merged[len - 1].sum;
        heap[nheap].seq = seq++;
        heap[nheap].subs = merged;
        heap[nheap].len = len;
        heap_up(heap, nheap);
        nheap++;
    }

    result = PyList_New(k);
    if (!result)
        goto cleanup;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *part = i < heap[0].len ? subset_items(&heap[0].subs[i], next, items)
                                         : PyList_New(0);
        if (!part) {
            Py_CLEAR(result);
            goto cleanup;
        }
        PyList_SET_ITEM(result, i, part);
    }

cleanup:
    if (heap) {
        for (Py_ssize_t i = 0; i < nheap; i++)
            PyMem_Free(heap[i].subs);
    }
    PyMem_Free(heap);
    PyMem_Free(next);
    PyMem_Free(tmp);
    PyMem_Free(fresh);
done:
    Py_DECREF(order);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* first-fit decreasing */

typedef struct {
    int64_t val;
    Py_ssize_t idx; /* index into positions: Python's stable sort keeps it as the tie-break */
} Item;

/* longest first, ties in input order */
static inline int
item_before(const Item *a, const Item *b)
{
    if (a->val != b->val)
        return a->val > b->val;
    return a->idx < b->idx;
}

DEFINE_STABLE_SORT(sort_items, Item, item_before)

PyDoc_STRVAR(ffd_doc,
"first_fit_decreasing(vals, positions, cap) -> (oversize, bins)\n\n"
"_balance._first_fit_decreasing: positions over ``cap`` and first-fit decreasing bins.");

static PyObject *
native_ffd(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *vals, *pos_arg;
    long long cap_ll;
    if (!PyArg_ParseTuple(args, "OOL:first_fit_decreasing", &vals, &pos_arg, &cap_ll))
        return NULL; /* a cap beyond int64 raises OverflowError: Python takes it */
    if (check_list(vals) < 0)
        return NULL;
    int64_t cap = (int64_t)cap_ll;
    PyObject *positions = PySequence_Fast(pos_arg, "positions must be a sequence");
    if (!positions)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(positions);
    PyObject **items = PySequence_Fast_ITEMS(positions);
    PyObject *result = NULL, *oversize = NULL, *bins = NULL;
    Item *rest = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Item));
    Item *scratch = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Item));
    Py_ssize_t *bin_of = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    Py_ssize_t *fill = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_ssize_t));
    int64_t *room = NULL;
    if (!rest || !scratch || !bin_of || !fill) {
        PyErr_NoMemory();
        goto done;
    }
    oversize = PyList_New(0);
    if (!oversize)
        goto done;
    Py_ssize_t nrest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        if (read_len(vals, items[i], &v, NULL) < 0)
            goto done;
        if (v > cap) {
            if (PyList_Append(oversize, items[i]) < 0)
                goto done;
        }
        else {
            rest[nrest].val = v;
            rest[nrest].idx = i;
            nrest++;
        }
    }
    sort_items(rest, nrest, scratch);

    Py_ssize_t size = 1;
    while (size < nrest)
        size *= 2;
    room = PyMem_Malloc((size_t)(2 * size) * sizeof(int64_t));
    if (!room) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < 2 * size; i++)
        room[i] = cap;
    Py_ssize_t nbins = 0;
    for (Py_ssize_t r = 0; r < nrest; r++) {
        int64_t x = rest[r].val;
        Py_ssize_t node = 1;
        while (node < size)
            node = room[2 * node] >= x ? 2 * node : 2 * node + 1;
        Py_ssize_t b = node - size;
        if (b == nbins)
            nbins++;
        bin_of[r] = b;
        fill[b]++;
        room[node] -= x;
        while (node > 1) {
            node /= 2;
            int64_t left = room[2 * node], right = room[2 * node + 1];
            int64_t best = left >= right ? left : right;
            if (room[node] == best)
                break;
            room[node] = best;
        }
    }
    bins = PyList_New(nbins);
    if (!bins)
        goto done;
    for (Py_ssize_t b = 0; b < nbins; b++) {
        PyObject *bin = PyList_New(fill[b]);
        if (!bin)
            goto done;
        PyList_SET_ITEM(bins, b, bin);
        fill[b] = 0;
    }
    for (Py_ssize_t r = 0; r < nrest; r++) {
        PyObject *bin = PyList_GET_ITEM(bins, bin_of[r]);
        PyObject *p = items[rest[r].idx];
        Py_INCREF(p);
        PyList_SET_ITEM(bin, fill[bin_of[r]]++, p);
    }
    result = PyTuple_Pack(2, oversize, bins);

done:
    Py_XDECREF(oversize);
    Py_XDECREF(bins);
    PyMem_Free(rest);
    PyMem_Free(scratch);
    PyMem_Free(bin_of);
    PyMem_Free(fill);
    PyMem_Free(room);
    Py_DECREF(positions);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* refinement: moves and swaps between heavy and light bins */

/* One sample in a bin: its length, its position and the position object handed back. */
typedef struct {
    int64_t val;
    Py_ssize_t pos;
    PyObject *obj; /* a new reference, released in refine's cleanup */
} Entry;

/* A bin: its samples in Python's list order (remove takes the first equal, append adds last). */
typedef struct {
    Entry *items;
    Py_ssize_t len;
    Py_ssize_t cap;
    int64_t sum;
} Bin;

/* Python sorts (vals[p], p) tuples. */
static inline int
entry_lt(const Entry *a, const Entry *b)
{
    if (a->val != b->val)
        return a->val < b->val;
    return a->pos < b->pos;
}

DEFINE_STABLE_SORT(sort_entries, Entry, entry_lt)

/* First index in the ascending e[0..n) whose val is >= v (bisect_left on the values, which is
 * also bisect_left on the tuples for (v, -1), positions being >= 0). */
static Py_ssize_t
lower_bound(const Entry *e, Py_ssize_t n, int64_t v)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (e[mid].val < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* _best_exchange: the move (position *out from heavy, *into = -1) or swap (*out for *into from
 * light) that shifts d tokens, 0 < d < diff, with max(d, diff - d) least, the first found on
 * ties; returns 0 if there is none. hv, lv and scratch have room for the bins' sizes. */
static int
best_exchange(const Bin *heavy, const Bin *light, int64_t diff, int moves, Entry *hv, Entry *lv,
              Entry *scratch, Py_ssize_t *out, Py_ssize_t *into)
{
    int64_t best = diff;
    int found = 0;
    Py_ssize_t nh = heavy->len, nl = light->len;
    memcpy(hv, heavy->items, (size_t)nh * sizeof(Entry));
    sort_entries(hv, nh, scratch);
    Py_ssize_t move = -1, give = -1, take = -1; /* indices into hv / lv */
    int64_t half = diff / 2;                     /* diff > 1: floor division */
    if (moves && nh > 1) {
        Py_ssize_t i = lower_bound(hv, nh, half);
        Py_ssize_t from = i - 1 > 0 ? i - 1 : 0, to = i + 2 < nh ? i + 2 : nh;
        for (Py_ssize_t c = from; c < to; c++) {
            int64_t x = hv[c].val;
            if (!(0 < x && x < diff))
                continue;
            int64_t score = x > diff - x ? x : diff - x;
            if (score < best) {
                best = score;
                move = c;
                found = 1;
            }
        }
    }
    memcpy(lv, light->items, (size_t)nl * sizeof(Entry));
    sort_entries(lv, nl, scratch);
    for (Py_ssize_t c = 0; c < nh; c++) {
        int64_t x = hv[c].val;
        if (c > 0 && x == hv[c - 1].val)
            continue; /* one try per distinct length, its first (lowest) position */
        Py_ssize_t j = lower_bound(lv, nl, x - half);
        Py_ssize_t from = j - 1 > 0 ? j - 1 : 0, to = j + 1 < nl ? j + 1 : nl;
        for (Py_ssize_t e = from; e < to; e++) {
            int64_t d = x - lv[e].val;
            if (!(0 < d && d < diff))
                continue; /* checked first: diff - d could overflow outside it */
            int64_t score = d > diff - d ? d : diff - d;
            if (score < best) {
                best = score;
                move = -1;
                give = c;
                take = e;
                found = 1;
            }
        }
    }
    if (!found)
        return 0;
    *out = move >= 0 ? hv[move].pos : hv[give].pos;
    *into = move >= 0 ? -1 : lv[take].pos;
    return 1;
}

/* list.remove: the index of the first item at position pos (there is one). */
static Py_ssize_t
bin_find(const Bin *b, Py_ssize_t pos)
{
    Py_ssize_t i = 0;
    while (b->items[i].pos != pos)
        i++;
    return i;
}

static int
bin_append(Bin *b, Entry e)
{
    if (b->len == b->cap) {
        Py_ssize_t cap = b->cap ? 2 * b->cap : 4;
        Entry *items = PyMem_Realloc(b->items, (size_t)cap * sizeof(Entry));
        if (!items) {
            PyErr_NoMemory();
            return -1;
        }
        b->items = items;
        b->cap = cap;
    }
    b->items[b->len++] = e;
    return 0;
}

static Entry
bin_remove(Bin *b, Py_ssize_t i)
{
    Entry e = b->items[i];
    memmove(b->items + i, b->items + i + 1, (size_t)(b->len - i - 1) * sizeof(Entry));
    b->len--;
    return e;
}

#define PARTNERS 4 /* _balance._PARTNERS: lightest bins a heavy bin tries to trade with */

PyDoc_STRVAR(refine_doc,
"refine(bins, vals, until, moves) -> list of lists\n\n"
"_balance._refine: lower heavy bins by moves to, or swaps with, light bins.");

static PyObject *
native_refine(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *bins_arg, *vals;
    long long until_ll;
    int moves;
    if (!PyArg_ParseTuple(args, "OOLp:refine", &bins_arg, &vals, &until_ll, &moves))
        return NULL; /* an ``until`` beyond int64 raises OverflowError: Python takes it */
    if (check_list(vals) < 0)
        return NULL;
    int64_t until = (int64_t)until_ll;
    PyObject *outer = PySequence_Fast(bins_arg, "bins must be a sequence of lists");
    if (!outer)
        return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(outer);
    if (k < 2) {
        Py_DECREF(outer);
        Py_INCREF(bins_arg); /* Python hands the same object back */
        return bins_arg;
    }
    PyObject *result = NULL;
    Py_ssize_t total_items = 0;
    Entry *hv = NULL, *lv = NULL, *scratch = NULL;
    char *stuck = NULL;
    Bin *bins = PyMem_Calloc((size_t)k, sizeof(Bin));
    if (!bins) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t b = 0; b < k; b++) {
        PyObject *inner = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, b),
                                          "bins must be a sequence of lists");
        if (!inner)
            goto done;
        Py_ssize_t len = PySequence_Fast_GET_SIZE(inner);
        PyObject **items = PySequence_Fast_ITEMS(inner);
        bins[b].items = PyMem_Malloc((size_t)(len ? len : 1) * sizeof(Entry));
        if (!bins[b].items) {
            Py_DECREF(inner);
            PyErr_NoMemory();
            goto done;
        }
        bins[b].cap = len ? len : 1;
        for (Py_ssize_t i = 0; i < len; i++) {
            Entry e;
            if (read_len(vals, items[i], &e.val, &e.pos) < 0 || add_total(&total, e.val) < 0) {
                Py_DECREF(inner);
                goto done;
            }
            Py_INCREF(items[i]);
            e.obj = items[i];
            bins[b].items[bins[b].len++] = e;
            bins[b].sum += e.val;
        }
        total_items += len;
        Py_DECREF(inner);
    }
    hv = PyMem_Malloc((size_t)(total_items ? total_items : 1) * sizeof(Entry));
    lv = PyMem_Malloc((size_t)(total_items ? total_items : 1) * sizeof(Entry));
    scratch = PyMem_Malloc((size_t)(total_items ? total_items : 1) * sizeof(Entry));
    stuck = PyMem_Calloc((size_t)k, 1);
    if (!hv || !lv || !scratch || !stuck) {
        PyErr_NoMemory();
        goto done;
    }

    for (Py_ssize_t step = 0; step < 4 * k + 16; step++) {
        /* Python sorts the bins by sum (stable: ties by index): the heaviest open bin is the
         * last open one in that order, i.e. ties go to the highest index; the partners are the
         * first PARTNERS in it. */
        Py_ssize_t hi = -1;
        for (Py_ssize_t b = 0; b < k; b++) {
            if (!stuck[b] && (hi < 0 || bins[b].sum >= bins[hi].sum))
                hi = b;
        }
        if (hi < 0 || bins[hi].sum <= until)
            break;
        Py_ssize_t light[PARTNERS];
        Py_ssize_t nlight = 0;
        for (Py_ssize_t b = 0; b < k; b++) {
            /* insert b after every lighter-or-equal one already held (stable order) */
            Py_ssize_t at = nlight;
            while (at > 0 && bins[b].sum < bins[light[at - 1]].sum)
                at--;
            if (at >= PARTNERS)
                continue;
            Py_ssize_t last = nlight < PARTNERS ? nlight : PARTNERS - 1;
            for (Py_ssize_t c = last; c > at; c--)
                light[c] = light[c - 1];
            light[at] = b;
            if (nlight < PARTNERS)
                nlight++;
        }
        Py_ssize_t lo = -1, out = -1, into = -1;
        int found = 0;
        for (Py_ssize_t c = 0; c < nlight; c++) {
            lo = light[c];
            int64_t diff = bins[hi].sum - bins[lo].sum;
            if (diff <= 1)
                break;
            if (best_exchange(&bins[hi], &bins[lo], diff, moves, hv, lv, scratch, &out,
                              &into)) {
                found = 1;
                break;
            }
        }
        if (!found) {
            if (until)
                break;
            stuck[hi] = 1;
            continue;
        }
        int64_t delta = 0;
        if (out >= 0) {
            Entry e = bin_remove(&bins[hi], bin_find(&bins[hi], out));
            delta += e.val;
            if (bin_append(&bins[lo], e) < 0) {
                Py_DECREF(e.obj); /* out of both bins now */
                goto done;
            }
        }
        if (into >= 0) {
            Entry e = bin_remove(&bins[lo], bin_find(&bins[lo], into));
            delta -= e.val;
            if (bin_append(&bins[hi], e) < 0) {
                Py_DECREF(e.obj);
                goto done;
            }
        }
        bins[hi].sum -= delta;
        bins[lo].sum += delta;
    }

    result = PyList_New(k);
    if (!result)
        goto done;
    for (Py_ssize_t b = 0; b < k; b++) {
        PyObject *list = PyList_New(bins[b].len);
        if (!list) {
            Py_CLEAR(result);
            goto done;
        }
        for (Py_ssize_t i = 0; i < bins[b].len; i++) {
            Py_INCREF(bins[b].items[i].obj);
            PyList_SET_ITEM(list, i, bins[b].items[i].obj);
        }
        PyList_SET_ITEM(result, b, list);
    }

done:
    if (bins) {
        for (Py_ssize_t b = 0; b < k; b++) {
            for (Py_ssize_t i = 0; i < bins[b].len; i++)
                Py_DECREF(bins[b].items[i].obj);
            PyMem_Free(bins[b].items);
        }
    }
    PyMem_Free(bins);
    PyMem_Free(hv);
    PyMem_Free(lv);
    PyMem_Free(scratch);
    PyMem_Free(stuck);
    Py_DECREF(outer);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* sorting helpers */

/* (key, index) pairs: sorting by key with the index as the tie-break is a stable sort. */
typedef struct {
    int64_t key;
    Py_ssize_t idx;
} Keyed;

static inline int
keyed_lt(const Keyed *a, const Keyed *b)
{
    if (a->key != b->key)
        return a->key < b->key;
    return a->idx < b->idx;
}

DEFINE_STABLE_SORT(sort_keyed, Keyed, keyed_lt)

PyDoc_STRVAR(descending_doc,
"descending(vals, positions) -> list\n\n"
"sorted(positions, key=vals.__getitem__, reverse=True): longest first, ties in input order.");

static PyObject *
native_descending(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *vals, *pos_arg;
    if (!PyArg_ParseTuple(args, "OO:descending", &vals, &pos_arg))
        return NULL;
    if (check_list(vals) < 0)
        return NULL;
    PyObject *positions = PySequence_Fast(pos_arg, "positions must be a sequence");
    if (!positions)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(positions);
    PyObject **items = PySequence_Fast_ITEMS(positions);
    PyObject *result = NULL;
    Keyed *keyed = PyMem_Malloc((size_t)(n ? 2 * n : 1) * sizeof(Keyed)); /* + sort scratch */
    if (!keyed) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        if (read_len(vals, items[i], &v, NULL) < 0)
            goto done;
        keyed[i].key = -v; /* v >= 0, so -v does not overflow */
        keyed[i].idx = i;
    }
    sort_keyed(keyed, n, keyed + n);
    result = PyList_New(n);
    if (!result)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = items[keyed[i].idx];
        Py_INCREF(p);
        PyList_SET_ITEM(result, i, p);
    }

done:
    PyMem_Free(keyed);
    Py_DECREF(positions);
    return result;
}

PyDoc_STRVAR(canonical_doc,
"canonical(groups) -> list of lists\n\n"
"_balance._canonical: each group sorted ascending, groups ordered by first position, empty\n"
"groups last.");

static PyObject *
native_canonical(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *outer = PySequence_Fast(arg, "groups must be a sequence of lists");
    if (!outer)
        return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(outer);
    PyObject *sorted_groups = PyList_New(k), *result = NULL;
    Keyed *firsts = PyMem_Malloc((size_t)(k ? 2 * k : 1) * sizeof(Keyed)); /* + sort scratch */
    Keyed *keyed = NULL;
    Py_ssize_t room = 0;
    if (!sorted_groups)
        goto done;
    if (!firsts) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t g = 0; g < k; g++) {
        PyObject *group = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, g),
                                          "groups must be a sequence of lists");
        if (!group)
            goto done;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(group);
        PyObject **items = PySequence_Fast_ITEMS(group);
        if (n > room) {
            PyMem_Free(keyed);
            room = n;
            keyed = PyMem_Malloc((size_t)(2 * room) * sizeof(Keyed)); /* + sort scratch */
            if (!keyed) {
                Py_DECREF(group);
                PyErr_NoMemory();
                goto done;
            }
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            /* positions: ints that fit a Py_ssize_t (OverflowError otherwise: Python takes it) */
            if (!PyLong_Check(items[i])) {
                Py_DECREF(group);
                PyErr_SetString(PyExc_TypeError, "positions must be ints");
                goto done;
            }
            Py_ssize_t p = PyLong_AsSsize_t(items[i]);
            if (p == -1 && PyErr_Occurred()) {
                Py_DECREF(group);
                goto done;
            }
            keyed[i].key = (int64_t)p;
            keyed[i].idx = i;
        }
        if (n > 1)
            sort_keyed(keyed, n, keyed + room);
        PyObject *out = PyList_New(n);
        if (!out) {
            Py_DECREF(group);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *p = items[keyed[i].idx];
            Py_INCREF(p);
            PyList_SET_ITEM(out, i, p);
        }
        PyList_SET_ITEM(sorted_groups, g, out);
        Py_DECREF(group);
        /* Python's key (0, g[0]), or (1, 0) for an empty group: empties after every position */
        firsts[g].key = n ? keyed[0].key : INT64_MAX;
        firsts[g].idx = g;
        if (n && keyed[0].key == INT64_MAX) {
            PyErr_SetString(PyExc_OverflowError, "position too large: left to Python");
            goto done;
        }
    }
    sort_keyed(firsts, k, firsts + k);
    result = PyList_New(k);
    if (!result)
        goto done;
    for (Py_ssize_t g = 0; g < k; g++) {
        PyObject *group = PyList_GET_ITEM(sorted_groups, firsts[g].idx);
        Py_INCREF(group);
        PyList_SET_ITEM(result, g, group);
    }

done:
    Py_XDECREF(sorted_groups);
    PyMem_Free(firsts);
    PyMem_Free(keyed);
    Py_DECREF(outer);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* module */

static PyMethodDef methods[] = {
    {"kk", native_kk, METH_VARARGS, kk_doc},
    {"first_fit_decreasing", native_ffd, METH_VARARGS, ffd_doc},
    {"refine", native_refine, METH_VARARGS, refine_doc},
    {"descending", native_descending, METH_VARARGS, descending_doc},
    {"canonical", native_canonical, METH_O, canonical_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "tqueue._native_balance",
    "C versions of the DP split planner's inner routines (tqueue/controller/_balance.py).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__native_balance(void)
{
    return PyModule_Create(&module);
}
