/* Ghosts: ARC's and S3-FIFO's ghost lists of evicted keys.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* ---------------------------------------------------------------- Ghosts */

/* A FIFO of keys with O(1) membership: ARC's B1 and B2, S3-FIFO's ghost queue,
 * with exactly an OrderedDict's semantics as those policies use one (adding a
 * present key keeps its place; a deleted key added again goes last), at a
 * dict operation per step and no method calls: ``map`` takes each present key
 * to the sequence number of its entry in ``ring``, where entries of keys deleted
 * since (or added again later) are stale and skipped. */
typedef struct {
    PyObject *map;          /* dict key -> int */
    PyObject **rkey;        /* ring[head:head+len]: keys (strong references) */
    long long *rseq;
    Py_ssize_t head, len, cap;
    long long next_seq;
} Ghosts;

static int
ghosts_init(Ghosts *g)
{
    memset(g, 0, sizeof *g);
    g->map = PyDict_New();
    return g->map ? 0 : -1;
}

static void
ghosts_clear(Ghosts *g)
{
    for (Py_ssize_t i = 0; i < g->len; i++)
        Py_DECREF(g->rkey[g->head + i]);
    PyMem_Free(g->rkey);
    PyMem_Free(g->rseq);
    g->rkey = NULL;
    g->rseq = NULL;
    g->head = g->len = g->cap = 0;
    Py_CLEAR(g->map);
}

static int
ghosts_traverse(Ghosts *g, visitproc visit, void *arg)
{
    Py_VISIT(g->map);
    for (Py_ssize_t i = 0; i < g->len; i++)
        Py_VISIT(g->rkey[g->head + i]);
    return 0;
}

/* 1: ring entry ``i`` (absolute) is its key's live one; 0: stale; -1: error. */
static int
ghosts_live(Ghosts *g, Py_ssize_t i)
{
    PyObject *v = PyDict_GetItemWithError(g->map, g->rkey[i]);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long long s = PyLong_AsLongLong(v);
    if (s == -1 && PyErr_Occurred())
        return -1;
    return s == g->rseq[i];
}

/* Room for one more entry: drop stale entries (compacting), else grow. */
static int
ghosts_room(Ghosts *g)
{
    if (g->head + g->len < g->cap)
        return 0;
    if (g->len > 2 * PyDict_GET_SIZE(g->map) + 16 || g->head > g->cap / 2) {
        Py_ssize_t m = 0;
        for (Py_ssize_t i = g->head; i < g->head + g->len; i++) {
            int live = ghosts_live(g, i);
            if (live < 0)
                return -1;
            if (live) {
                g->rkey[m] = g->rkey[i];
                g->rseq[m++] = g->rseq[i];
            }
            else {
                Py_DECREF(g->rkey[i]);
            }
        }
        g->head = 0;
        g->len = m;
        if (m < g->cap / 2 + 1 && g->cap)
            return 0;
    }
    Py_ssize_t cap = g->cap ? 2 * g->cap : 64;
    PyObject **k = PyMem_Realloc(g->rkey, cap * sizeof(PyObject *));
    if (k == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    g->rkey = k;
    long long *s = PyMem_Realloc(g->rseq, cap * sizeof(long long));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    g->rseq = s;
    g->cap = cap;
    return 0;
}

/* ``od[key] = None``: last if new, in place if present. */
static int
ghosts_add(Ghosts *g, PyObject *key)
{
    int in = PyDict_Contains(g->map, key);
    if (in)
        return in < 0 ? -1 : 0;
    if (ghosts_room(g) < 0)
        return -1;
    PyObject *seq = PyLong_FromLongLong(g->next_seq);
    if (seq == NULL)
        return -1;
    int r = PyDict_SetItem(g->map, key, seq);
    Py_DECREF(seq);
    if (r < 0)
        return -1;
    Py_ssize_t i = g->head + g->len++;
    g->rkey[i] = Py_NewRef(key);
    g->rseq[i] = g->next_seq++;
    return 0;
}

/* ``od.pop(key, None)``: 1 if it was there. */
static int
ghosts_discard(Ghosts *g, PyObject *key)
{
    int in = PyDict_Contains(g->map, key);
    if (in <= 0)
        return in;
    return PyDict_DelItem(g->map, key) < 0 ? -1 : 1;
}

/* ``od.popitem(last=False)`` (the caller knows it is not empty). */
static int
ghosts_pop_oldest(Ghosts *g)
{
    while (g->len) {
        Py_ssize_t i = g->head;
        int live = ghosts_live(g, i);
        if (live < 0)
            return -1;
        PyObject *key = g->rkey[i];
        g->head++;
        g->len--;
        int r = live ? PyDict_DelItem(g->map, key) : 0;
        Py_DECREF(key);
        if (live)
            return r;
    }
    PyErr_SetString(PyExc_KeyError, "ghost list is empty");
    return -1;
}

#define GHOSTS_LEN(g) PyDict_GET_SIZE((g)->map)

/* The present keys, oldest first, as an OrderedDict (what the Python classes keep). */
static PyObject *
ghosts_snapshot(Ghosts *g)
{
    PyObject *mod = PyImport_ImportModule("collections");
    PyObject *odt = mod ? PyObject_GetAttrString(mod, "OrderedDict") : NULL;
    Py_XDECREF(mod);
    PyObject *od = odt ? PyObject_CallNoArgs(odt) : NULL;
    Py_XDECREF(odt);
    for (Py_ssize_t i = g->head; od && i < g->head + g->len; i++) {
        int live = ghosts_live(g, i);
        if (live < 0 || (live && PyObject_SetItem(od, g->rkey[i], Py_None) < 0))
            Py_CLEAR(od);
    }
    return od;
}
