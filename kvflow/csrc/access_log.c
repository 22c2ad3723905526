/* AccessLog: a trace's block accesses, recorded compactly (Belady's MIN over them:
 * access_log_belady.c).
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

/* In access_log_belady.c (included next). */
static PyObject *AccessLog_hits(AccessLogObject *o, PyObject *arg);

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
