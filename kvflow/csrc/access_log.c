/* AccessLog: a trace's accesses, compact, and Belady's MIN over them.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* ------------------------------------------------------------- AccessLog */

/* A trace's block accesses, recorded compactly for the offline optimum
 * (kvflow.headroom): each request's keys interned to dense int32 ids as it
 * streams past, so that memory is ~4 bytes an access (ids), 8 a request
 * (offsets) and, while recording, a hash table of the distinct keys, instead
 * of every request's key objects. ``finish`` computes each access's next use
 * in one backward pass (another 4 bytes an access) and frees the table; ``hits``
 * runs Belady's MIN over the arrays exactly as traces.optimum.optimum_hits does
 * over the keys (same evictions, same tie-breaks: the result is the same
 * number, checked in tests/test_headroom_compact.py).
 *
 * Keys that are ints in int64 range (trace hash ids) live in the C table; any
 * other hashable (a tenant's (tenant, id) tuple, a hasher's bytes) in a dict
 * beside it, so equal keys get equal ids either way. */

typedef struct {
    PyObject_HEAD
    Py_ssize_t cut;           /* each request keeps its first ``cut`` keys */
    int32_t *ids;             /* per access */
    Py_ssize_t n, ncap;
    int64_t *starts;          /* per request, and one past the end */
    Py_ssize_t nreq, rcap;
    int32_t *nexts;           /* per access after finish: next request using it, or -1 */
    int64_t *tkeys;           /* by id: the int key (others: unset) */
    Py_ssize_t kcap;
    int32_t *tvals;           /* the int keys' table (open addressing): ids, -1 empty */
    Py_ssize_t tmask, tused;
    PyObject *other;          /* dict: non-int key -> id */
    int32_t nkeys;
    long long blocks;         /* every key of every request, untruncated */
    int finished;
} AccessLogObject;

static PyTypeObject AccessLogType;

static uint64_t
al_mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* The int keys' table: slots hold ids (-1: empty), ``ukeys[id]`` the key, so a
 * distinct key costs 8 bytes plus 4 per slot (load <= 3/4), not a Python int in a
 * dict (~100 bytes). */
static int
al_table_grow(AccessLogObject *o)
{
    Py_ssize_t size = o->tmask ? 2 * (o->tmask + 1) : 1024;
    int32_t *slots = PyMem_Malloc(size * sizeof(int32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++)
        slots[i] = -1;
    Py_ssize_t mask = size - 1;
    for (Py_ssize_t i = 0; o->tmask && i <= o->tmask; i++) {
        int32_t id = o->tvals[i];
        if (id < 0)
            continue;
        Py_ssize_t j = (Py_ssize_t)(al_mix((uint64_t)o->tkeys[id]) & (uint64_t)mask);
        while (slots[j] >= 0)
            j = (j + 1) & mask;
        slots[j] = id;
    }
    PyMem_Free(o->tvals);
    o->tvals = slots;
    o->tmask = mask;
    return 0;
}

/* The id of an int key, made if new; -1 on error. */
static int32_t
al_int_id(AccessLogObject *o, int64_t k)
{
    if (4 * (o->tused + 1) > 3 * (o->tmask + 1) && al_table_grow(o) < 0)
        return -1;
    Py_ssize_t j = (Py_ssize_t)(al_mix((uint64_t)k) & (uint64_t)o->tmask);
    int32_t id;
    while ((id = o->tvals[j]) >= 0) {
        if (o->tkeys[id] == k)
            return id;
        j = (j + 1) & o->tmask;
    }
    if (o->nkeys == INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "AccessLog: more than 2**31 distinct keys");
        return -1;
    }
    if (o->nkeys >= o->kcap) {
        Py_ssize_t cap = o->kcap ? o->kcap + o->kcap / 2 : 1024;
        int64_t *keys = PyMem_Realloc(o->tkeys, cap * sizeof(int64_t));
        if (keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->tkeys = keys;
        o->kcap = cap;
    }
    o->tkeys[o->nkeys] = k;
    o->tvals[j] = o->nkeys;
    o->tused++;
    return o->nkeys++;
}

static int32_t
al_other_id(AccessLogObject *o, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(o->other, key);
    if (v != NULL)
        return (int32_t)PyLong_AsLong(v);
    if (PyErr_Occurred())
        return -1;
    if (o->nkeys == INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "AccessLog: more than 2**31 distinct keys");
        return -1;
    }
    PyObject *id = PyLong_FromLong(o->nkeys);
    if (id == NULL || PyDict_SetItem(o->other, key, id) < 0) {
        Py_XDECREF(id);
        return -1;
    }
    Py_DECREF(id);
    return o->nkeys++;
}

static PyObject *
AccessLog_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cut", NULL};
    Py_ssize_t cut;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:AccessLog", kwlist, &cut))
        return NULL;
    AccessLogObject *o = (AccessLogObject *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->cut = cut;
    o->other = PyDict_New();
    o->starts = PyMem_Malloc(64 * sizeof(int64_t));
    if (o->other == NULL || o->starts == NULL) {
        Py_DECREF(o);
        return PyErr_NoMemory();
    }
    o->rcap = 64;
    o->starts[0] = 0;
    return (PyObject *)o;
}

static void
al_free_table(AccessLogObject *o)
{
    PyMem_Free(o->tkeys);
    PyMem_Free(o->tvals);
    o->tkeys = NULL;
    o->tvals = NULL;
    o->tmask = o->tused = o->kcap = 0;
    Py_CLEAR(o->other);
}

static void
AccessLog_dealloc(AccessLogObject *o)
{
    al_free_table(o);
    PyMem_Free(o->ids);
    PyMem_Free(o->starts);
    PyMem_Free(o->nexts);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *
AccessLog_add(AccessLogObject *o, PyObject *arg)
{
    if (o->finished) {
        PyErr_SetString(PyExc_RuntimeError, "AccessLog.add after finish");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "AccessLog.add takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* as Python's r[:cut] (a negative cut drops from the end) */
    Py_ssize_t take = o->cut >= 0 ? (len < o->cut ? len : o->cut)
                                  : (len + o->cut > 0 ? len + o->cut : 0);
    if (o->nreq + 2 > o->rcap) {
        Py_ssize_t cap = 2 * o->rcap;
        int64_t *s = PyMem_Realloc(o->starts, cap * sizeof(int64_t));
        if (s == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        o->starts = s;
        o->rcap = cap;
    }
    if (o->n + take > o->ncap) {
        Py_ssize_t cap = o->ncap ? o->ncap : 1024;
        while (cap < o->n + take)
            cap *= 2;
        int32_t *ids = PyMem_Realloc(o->ids, cap * sizeof(int32_t));
        if (ids == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        o->ids = ids;
        o->ncap = cap;
    }
    Py_ssize_t n0 = o->n;
    for (Py_ssize_t i = 0; i < take; i++) {
        PyObject *k = items[i];
        int32_t id;
        int overflow = 0;
        long long v = 0;
        if (PyLong_Check(k))
            v = PyLong_AsLongLongAndOverflow(k, &overflow);
        if (PyLong_Check(k) && !overflow) {
            if (v == -1 && PyErr_Occurred())
                id = -1;
            else
                id = al_int_id(o, (int64_t)v);
        }
        else {
            id = al_other_id(o, k);
        }
        if (id < 0) {
            o->n = n0;  /* nothing of this request recorded (its new ids stay unused) */
            Py_DECREF(seq);
            return NULL;
        }
        o->ids[o->n++] = id;
    }
    o->starts[++o->nreq] = o->n;
    o->blocks += len;
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
AccessLog_finish(AccessLogObject *o, PyObject *unused)
{
    if (o->finished)
        Py_RETURN_NONE;
    al_free_table(o);
    Py_ssize_t n = o->n;
    int32_t *last = PyMem_Malloc((o->nkeys ? o->nkeys : 1) * sizeof(int32_t));
    o->nexts = PyMem_Malloc((n ? n : 1) * sizeof(int32_t));
    if (last == NULL || o->nexts == NULL) {
        PyMem_Free(last);
        PyMem_Free(o->nexts);
        o->nexts = NULL;
        return PyErr_NoMemory();
    }
    for (int32_t k = 0; k < o->nkeys; k++)
        last[k] = -1;
    for (Py_ssize_t i = o->nreq - 1; i >= 0; i--) {
        int64_t a = o->starts[i], b = o->starts[i + 1];
        for (int64_t p = a; p < b; p++)
            o->nexts[p] = last[o->ids[p]];
        for (int64_t p = a; p < b; p++)
            last[o->ids[p]] = (int32_t)i;
    }
    PyMem_Free(last);
    o->finished = 1;
    Py_RETURN_NONE;
}

/* Belady's MIN heap entry: the largest (next use, depth) first, then the oldest. */
typedef struct {
    int64_t pri;   /* (next use << 20) | depth */
    int64_t seq;
    int32_t id;
} BeladyEntry;

static inline int
be_before(const BeladyEntry *a, const BeladyEntry *b)
{
    return a->pri > b->pri || (a->pri == b->pri && a->seq < b->seq);
}

static void
be_push(BeladyEntry *h, Py_ssize_t *len, BeladyEntry e)
{
    Py_ssize_t i = (*len)++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!be_before(&e, &h[up]))
            break;
        h[i] = h[up];
        i = up;
    }
    h[i] = e;
}

static BeladyEntry
be_pop(BeladyEntry *h, Py_ssize_t *len)
{
    BeladyEntry top = h[0], e = h[--(*len)];
    Py_ssize_t n = *len, i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && be_before(&h[c + 1], &h[c]))
            c++;
        if (!be_before(&h[c], &e))
            break;
        h[i] = h[c];
        i = c;
    }
    if (n)
        h[i] = e;
    return top;
}

static PyObject *
AccessLog_hits(AccessLogObject *o, PyObject *arg)
{
    Py_ssize_t capacity = PyLong_AsSsize_t(arg);
    if (capacity == -1 && PyErr_Occurred())
        return NULL;
    if (!o->finished) {
        PyErr_SetString(PyExc_RuntimeError, "AccessLog.hits before finish");
        return NULL;
    }
    if (capacity <= 0)
        return PyLong_FromLong(0);
    Py_ssize_t nk = o->nkeys ? o->nkeys : 1;
    int32_t *cached = PyMem_Malloc(nk * sizeof(int32_t)); /* next use; -2: not cached */
    int32_t *mine = PyMem_Malloc(nk * sizeof(int32_t));   /* request holding it now */
    Py_ssize_t dcap = 1024, hcap = 1024;
    int32_t *dead = PyMem_Malloc(dcap * sizeof(int32_t));
    BeladyEntry *heap = PyMem_Malloc(hcap * sizeof(BeladyEntry));
    BeladyEntry *held = NULL;
    Py_ssize_t heldcap = 0;
    if (!cached || !mine || !dead || !heap)
        goto nomem;
    for (Py_ssize_t k = 0; k < nk; k++) {
        cached[k] = -2;
        mine[k] = -1;
    }
    Py_ssize_t dhead = 0, dlen = 0;  /* dead[dhead:dhead+dlen] */
    Py_ssize_t hlen = 0, ncached = 0;
    long long hits = 0;
    int64_t seq = 0;
    for (Py_ssize_t i = 0; i < o->nreq; i++) {
        int64_t a = o->starts[i], b = o->starts[i + 1];
        for (int64_t p = a; p < b && cached[o->ids[p]] != -2; p++)
            hits++;
        Py_ssize_t fresh_dead = 0;
        for (int64_t p = a; p < b; p++) {
            int32_t id = o->ids[p], nu = o->nexts[p];
            if (cached[id] == -2)
                ncached++;
            cached[id] = nu;
            mine[id] = (int32_t)i;
            if (nu < 0) {
                if (dhead + dlen == dcap) {
                    if (dhead > dcap / 2) {
                        memmove(dead, dead + dhead, dlen * sizeof(int32_t));
                        dhead = 0;
                    } else {
                        int32_t *d = PyMem_Realloc(dead, 2 * dcap * sizeof(int32_t));
                        if (d == NULL)
                            goto nomem;
                        dead = d;
                        dcap *= 2;
                    }
                }
                dead[dhead + dlen++] = id;
                fresh_dead++;
            } else {
                if (hlen == hcap) {
                    BeladyEntry *h = PyMem_Realloc(heap, 2 * hcap * sizeof(BeladyEntry));
                    if (h == NULL)
                        goto nomem;
                    heap = h;
                    hcap *= 2;
                }
                BeladyEntry e = {((int64_t)nu << 20) | (int64_t)(p - a), seq++, id};
                be_push(heap, &hlen, e);
            }
        }
        Py_ssize_t over = ncached - capacity;
        if (over <= 0)
            continue;
        while (over > 0 && dlen > fresh_dead) {  /* this request's blocks stay */
            int32_t id = dead[dhead++];
            dlen--;
            if (cached[id] == -1) {
                cached[id] = -2;
                ncached--;
                over--;
            }
        }
        Py_ssize_t nheld = 0;
        while (over > 0 && hlen > 0) {
            BeladyEntry e = be_pop(heap, &hlen);
            if (cached[e.id] != (int32_t)(e.pri >> 20))
                continue;  /* stale: used (and queued again) since */
            if (mine[e.id] == (int32_t)i) {
                if (nheld == heldcap) {
                    Py_ssize_t c = heldcap ? 2 * heldcap : 64;
                    BeladyEntry *hh = PyMem_Realloc(held, c * sizeof(BeladyEntry));
                    if (hh == NULL)
                        goto nomem;
                    held = hh;
                    heldcap = c;
                }
                held[nheld++] = e;
                continue;
            }
            cached[e.id] = -2;
            ncached--;
            over--;
        }
        for (Py_ssize_t j = 0; j < nheld; j++)
            be_push(heap, &hlen, held[j]);
        if (hlen > 2 * ncached + 4096) {  /* drop stale entries (order unchanged) */
            Py_ssize_t m = 0;
            for (Py_ssize_t j = 0; j < hlen; j++)
                if (cached[heap[j].id] == (int32_t)(heap[j].pri >> 20))
                    heap[m++] = heap[j];
            Py_ssize_t len = 0;
            for (Py_ssize_t j = 0; j < m; j++)
                be_push(heap, &len, heap[j]);
            hlen = len;
        }
    }
    PyMem_Free(cached);
    PyMem_Free(mine);
    PyMem_Free(dead);
    PyMem_Free(heap);
    PyMem_Free(held);
    return PyLong_FromLongLong(hits);
nomem:
    PyMem_Free(cached);
    PyMem_Free(mine);
    PyMem_Free(dead);
    PyMem_Free(heap);
    PyMem_Free(held);
    return PyErr_NoMemory();
}

static PyObject *
al_array(const void *data, Py_ssize_t count, Py_ssize_t itemsize)
{
    return PyBytes_FromStringAndSize((const char *)data, count * itemsize);
}

static PyObject *
AccessLog_ids(AccessLogObject *o, PyObject *unused)
{
    return al_array(o->ids, o->n, sizeof(int32_t));
}

static PyObject *
AccessLog_starts(AccessLogObject *o, PyObject *unused)
{
    return al_array(o->starts, o->nreq + 1, sizeof(int64_t));
}

static PyObject *
AccessLog_nexts(AccessLogObject *o, PyObject *unused)
{
    if (!o->finished) {
        PyErr_SetString(PyExc_RuntimeError, "AccessLog.nexts before finish");
        return NULL;
    }
    return al_array(o->nexts, o->n, sizeof(int32_t));
}

static PyObject *
AccessLog_get(AccessLogObject *o, void *which)
{
    switch ((int)(intptr_t)which) {
    case 0: return PyLong_FromSsize_t(o->nreq);
    case 1: return PyLong_FromSsize_t(o->n);
    case 2: return PyLong_FromLong(o->nkeys);
    case 3: return PyLong_FromLongLong(o->blocks);
    case 4: return PyLong_FromSsize_t(o->cut);
    default: return PyBool_FromLong(o->finished);
    }
}

static PyObject *
AccessLog_nbytes(AccessLogObject *o, PyObject *unused)
{
    Py_ssize_t b = o->ncap * sizeof(int32_t) + o->rcap * sizeof(int64_t) +
                   (o->nexts ? o->n * sizeof(int32_t) : 0) +
                   (o->tmask ? (o->tmask + 1) * sizeof(int32_t) : 0) +
                   o->kcap * sizeof(int64_t);
    return PyLong_FromSsize_t(b);
}

static PyMethodDef AccessLog_methods[] = {
    {"add", (PyCFunction)AccessLog_add, METH_O,
     "Record a request's keys (its first ``cut``; every key counts in ``blocks``)."},
    {"finish", (PyCFunction)AccessLog_finish, METH_NOARGS,
     "No more requests: compute next uses, free the key table."},
    {"hits", (PyCFunction)AccessLog_hits, METH_O,
     "Blocks Belady's MIN hits with this many blocks (traces.optimum.optimum_hits)."},
    {"ids", (PyCFunction)AccessLog_ids, METH_NOARGS, "The accesses' key ids (int32 bytes)."},
    {"starts", (PyCFunction)AccessLog_starts, METH_NOARGS,
     "Each request's first access, and the end (int64 bytes)."},
    {"nexts", (PyCFunction)AccessLog_nexts, METH_NOARGS,
     "Each access's next use (request index, -1: none; int32 bytes)."},
    {"nbytes", (PyCFunction)AccessLog_nbytes, METH_NOARGS, "Bytes held now."},
    {NULL},
};

static PyGetSetDef AccessLog_getset[] = {
    {"requests", (getter)AccessLog_get, NULL, NULL, (void *)0},
    {"accesses", (getter)AccessLog_get, NULL, NULL, (void *)1},
    {"keys", (getter)AccessLog_get, NULL, NULL, (void *)2},
    {"blocks", (getter)AccessLog_get, NULL, NULL, (void *)3},
    {"cut", (getter)AccessLog_get, NULL, NULL, (void *)4},
    {"finished", (getter)AccessLog_get, NULL, NULL, (void *)5},
    {NULL},
};

static PyTypeObject AccessLogType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.AccessLog",
    .tp_doc = "A trace's block accesses as int32 ids, for the offline optimum.",
    .tp_basicsize = sizeof(AccessLogObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = AccessLog_tp_new,
    .tp_dealloc = (destructor)AccessLog_dealloc,
    .tp_methods = AccessLog_methods,
    .tp_getset = AccessLog_getset,
};
