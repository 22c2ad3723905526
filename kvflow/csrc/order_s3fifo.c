/* LinkedS3FIFO and its candidates scan.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* ----------------------------------------------------------- LinkedS3FIFO */

/* kvflow.policy.S3FIFO with its small and main FIFOs linked through the nodes
 * (the per-tier links; one policy per tier) and its scan (``candidates``) an
 * iterator in C: S3-FIFO has no O(1) front (eviction moves blocks between the
 * queues), so every eviction runs the scan, and the Python generator, one call
 * per block with its queue moves, cost ~4-8x LRU's time in cache mode. The ghost
 * FIFO of evicted keys is a ``Ghosts`` (S3FIFO's OrderedDict's semantics). A tracked node
 * is linked; ``rank[t]`` holds its queue (1 small, 2 main) << 8 | its frequency. */

#define S3_SMALL 1
#define S3_MAIN 2
#define S3_MAX_FREQ 3

typedef struct {
    PyObject_HEAD
    int tier;
    Py_ssize_t capacity;
    NodeList q[3];          /* q[1]: small, q[2]: main */
    Ghosts ghost;
} S3Object;

typedef struct {
    PyObject_HEAD
    S3Object *policy;
    PyObject *offered;      /* set of nodes */
    NodeObject *pending;    /* offered last: to the end of its queue if still tracked */
    int pending_q;
    PyObject *tail;         /* phase 2: the rest in plain order (a list), or NULL */
    Py_ssize_t at;
} S3ScanObject;

static PyTypeObject S3Type, S3ScanType;

#define S3_Q(o, n) ((int)((n)->rank[(o)->tier] >> 8))
#define S3_F(o, n) ((int)((n)->rank[(o)->tier] & 0xff))

static void
s3_append(S3Object *o, NodeObject *n, int q, int freq)
{
    int t = o->tier;
    NodeList *l = &o->q[q];
    Py_INCREF(n);
    n->rank[t] = ((long long)q << 8) | freq;
    list_push_back(&l->head, &l->tail, n, t);
    l->size++;
}

/* Unlink a linked node; the caller inherits the queue's reference. */
static void
s3_unlink(S3Object *o, NodeObject *n)
{
    int t = o->tier;
    NodeList *l = &o->q[S3_Q(o, n)];
    list_unlink(&l->head, &l->tail, n, t);
    n->rank[t] = 0;
    l->size--;
}

static PyObject *
S3_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "capacity", NULL};
    int tier;
    Py_ssize_t capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|n:LinkedS3FIFO", kwlist, &tier,
                                     &capacity))
        return NULL;
    if (check_tier(tier) < 0)
        return NULL;
    S3Object *o = (S3Object *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->tier = tier;
    o->capacity = capacity < 1 ? 1 : capacity;
    if (ghosts_init(&o->ghost) < 0) {
        Py_DECREF(o);
        return NULL;
    }
    return (PyObject *)o;
}

static int
S3_traverse(S3Object *o, visitproc visit, void *arg)
{
    for (int q = 1; q <= 2; q++)
        for (NodeObject *n = o->q[q].head; n; n = n->next[o->tier])
            Py_VISIT(n);
    return ghosts_traverse(&o->ghost, visit, arg);
}

static int
S3_clear(S3Object *o)
{
    for (int q = 1; q <= 2; q++)
        while (o->q[q].head) {
            NodeObject *n = o->q[q].head;
            s3_unlink(o, n);
            Py_DECREF(n);
        }
    ghosts_clear(&o->ghost);
    return 0;
}

static void
S3_dealloc(S3Object *o)
{
    PyObject_GC_UnTrack(o);
    S3_clear(o);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *
S3_insert(S3Object *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (LINKED(o, n)) {  /* queued already: it keeps its place, its frequency resets */
        n->rank[o->tier] = (long long)S3_Q(o, n) << 8;
        Py_RETURN_NONE;
    }
    int in = ghosts_discard(&o->ghost, n->key);
    if (in < 0)
        return NULL;
    if (in) {  /* evicted from small not long ago: straight to main */
        s3_append(o, n, S3_MAIN, 0);
    }
    else {
        s3_append(o, n, S3_SMALL, 0);
    }
    Py_RETURN_NONE;
}

static PyObject *
S3_ref(S3Object *o, PyObject *arg)
{
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
    int f = S3_F(o, n) + 1;
    n->rank[o->tier] = ((long long)S3_Q(o, n) << 8) | (f < S3_MAX_FREQ ? f : S3_MAX_FREQ);
    Py_RETURN_NONE;
}

static PyObject *
S3_unref(S3Object *o, PyObject *arg)
{
    Py_RETURN_NONE;
}

static PyObject *
S3_remove(S3Object *o, PyObject *arg)
{
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
    int q = S3_Q(o, n);
    s3_unlink(o, n);
    if (q == S3_SMALL) {
        int r = ghosts_add(&o->ghost, n->key);
        Py_DECREF(n);
        if (r < 0)
            return NULL;
        while (GHOSTS_LEN(&o->ghost) > o->capacity)
            if (ghosts_pop_oldest(&o->ghost) < 0)
                return NULL;
    }
    else {
        Py_DECREF(n);
    }
    Py_RETURN_NONE;
}

static PyObject *
S3_first(S3Object *o, PyObject *unused)
{
    Py_RETURN_NONE;  /* no O(1) answer: eviction moves queues, callers scan */
}

static PyObject *
S3_pop_front(S3Object *o, PyObject *arg)
{
    return PyList_New(0);
}

static PyObject *
S3_push_front(S3Object *o, PyObject *arg)
{
    Py_ssize_t len = PyObject_Length(arg);
    if (len < 0)
        return NULL;
    if (len) {
        PyErr_SetString(PyExc_AssertionError, "S3FIFO.pop_front hands out no nodes");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
s3_queue_list(S3Object *o, int q)
{
    PyObject *out = PyList_New(o->q[q].size);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (NodeObject *n = o->q[q].head; n; n = n->next[o->tier])
        PyList_SET_ITEM(out, i++, Py_NewRef(n));
    return out;
}

static PyObject *
S3_queue(S3Object *o, PyObject *arg)
{
    long q = PyLong_AsLong(arg);
    if (q == -1 && PyErr_Occurred())
        return NULL;
    if (q != S3_SMALL && q != S3_MAIN) {
        PyErr_SetString(PyExc_ValueError, "S3-FIFO queues are 1 (small) and 2 (main)");
        return NULL;
    }
    return s3_queue_list(o, (int)q);
}

static PyObject *
S3_freq(S3Object *o, PyObject *arg)
{
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
    return PyLong_FromLong(S3_F(o, n));
}

static PyObject *
S3_holds(S3Object *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    return PyBool_FromLong(LINKED(o, (NodeObject *)arg));
}

static PyObject *
S3_tracked(S3Object *o, PyObject *unused)
{
    PyObject *s = PySet_New(NULL);
    for (int q = 1; s && q <= 2; q++)
        if (list_add_to_set(s, o->q[q].head, o->tier) < 0)
            Py_CLEAR(s);
    return s;
}

static PyObject *
S3_candidates(S3Object *o, PyObject *unused)
{
    S3ScanObject *it = PyObject_GC_New(S3ScanObject, &S3ScanType);
    if (it == NULL)
        return NULL;
    it->policy = (S3Object *)Py_NewRef(o);
    it->offered = PySet_New(NULL);
    it->pending = NULL;
    it->pending_q = 0;
    it->tail = NULL;
    it->at = 0;
    PyObject_GC_Track(it);
    if (it->offered == NULL) {
        Py_DECREF(it);
        return NULL;
    }
    return (PyObject *)it;
}

static Py_ssize_t
S3_len(S3Object *o)
{
    return o->q[1].size + o->q[2].size;
}

static PyObject *
S3_get(S3Object *o, void *which)
{
    switch ((int)(intptr_t)which) {
    case 0: return PyLong_FromLong(o->tier);
    case 1: return PyLong_FromSsize_t(o->capacity);
    default: return ghosts_snapshot(&o->ghost);
    }
}

static PyMethodDef S3_methods[] = {
    {"insert", (PyCFunction)S3_insert, METH_O, "A ready copy: small (main if a ghost)."},
    {"remove", (PyCFunction)S3_remove, METH_O, "Forget a copy (from small: a ghost)."},
    {"ref", (PyCFunction)S3_ref, METH_O, "An access: its frequency up (to 3)."},
    {"unref", (PyCFunction)S3_unref, METH_O, "Nothing: blocks keep their place."},
    {"unref_all", (PyCFunction)S3_unref, METH_O, "Nothing: blocks keep their place."},
    {"first", (PyCFunction)S3_first, METH_NOARGS, "None: callers scan candidates."},
    {"pop_front", (PyCFunction)S3_pop_front, METH_O, "[]: see first."},
    {"push_front", (PyCFunction)S3_push_front, METH_O, "Only [] (pop_front hands out none)."},
    {"candidates", (PyCFunction)S3_candidates, METH_NOARGS,
     "The scan, with the algorithm's queue moves (an iterator, as S3FIFO's generator)."},
    {"queue", (PyCFunction)S3_queue, METH_O, "Small (1) or main (2), oldest first."},
    {"freq", (PyCFunction)S3_freq, METH_O, "A tracked node's frequency."},
    {"holds", (PyCFunction)S3_holds, METH_O, "Whether the node is tracked here."},
    {"tracked", (PyCFunction)S3_tracked, METH_NOARGS, "The tracked nodes, as a set."},
    {NULL},
};

static PyGetSetDef S3_getset[] = {
    {"tier", (getter)S3_get, NULL, NULL, (void *)0},
    {"capacity", (getter)S3_get, NULL, NULL, (void *)1},
    {"_ghost", (getter)S3_get, NULL, NULL, (void *)2},
    {NULL},
};

static PySequenceMethods S3_as_sequence = {
    .sq_length = (lenfunc)S3_len,
};

static PyTypeObject S3Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.LinkedS3FIFO",
    .tp_doc = "S3-FIFO over one tier's copies, its queues linked through the nodes.",
    .tp_basicsize = sizeof(S3Object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = S3_tp_new,
    .tp_dealloc = (destructor)S3_dealloc,
    .tp_traverse = (traverseproc)S3_traverse,
    .tp_clear = (inquiry)S3_clear,
    .tp_as_sequence = &S3_as_sequence,
    .tp_methods = S3_methods,
    .tp_getset = S3_getset,
};

static int
S3Scan_traverse(S3ScanObject *it, visitproc visit, void *arg)
{
    Py_VISIT(it->policy);
    Py_VISIT(it->offered);
    Py_VISIT(it->pending);
    Py_VISIT(it->tail);
    return 0;
}

static int
S3Scan_clear(S3ScanObject *it)
{
    Py_CLEAR(it->policy);
    Py_CLEAR(it->offered);
    Py_CLEAR(it->pending);
    Py_CLEAR(it->tail);
    return 0;
}

static void
S3Scan_dealloc(S3ScanObject *it)
{
    PyObject_GC_UnTrack(it);
    S3Scan_clear(it);
    PyObject_GC_Del(it);
}

/* S3FIFO.candidates, one step: what runs after the previous yield, then on to the
 * next one. Queue moves happen only while scanning; a node the caller declined
 * (still tracked when asked for the next) goes to the end of its queue; once the
 * scan meets a node offered already, the rest are offered in plain order. */
static PyObject *
S3Scan_next(S3ScanObject *it)
{
    S3Object *o = it->policy;
    if (o == NULL)
        return NULL;
    if (it->tail == NULL) {
        if (it->pending) {
            NodeObject *n = it->pending;
            it->pending = NULL;
            if (LINKED(o, n)) {  /* declined: behind the rest of its queue */
                int f = S3_F(o, n);
                s3_unlink(o, n);
                s3_append(o, n, it->pending_q, f);
                Py_DECREF(n);  /* the queue's old reference */
            }
            Py_DECREF(n);  /* ours */
        }
        while (o->q[1].size || o->q[2].size) {
            Py_ssize_t ls = o->q[1].size;
            int use_small = ls && ((double)ls >= 0.1 * (double)o->capacity || !o->q[2].size);
            int q = use_small ? S3_SMALL : S3_MAIN;
            NodeObject *n = o->q[q].head;
            int seen = PySet_Contains(it->offered, (PyObject *)n);
            if (seen < 0)
                return NULL;
            if (seen)
                break;
            int f = S3_F(o, n);
            if (f > 0) {  /* promote from small, or give a main block another round */
                Py_INCREF(n);
                s3_unlink(o, n);
                Py_DECREF(n);  /* the queue's old reference (ours keeps it) */
                s3_append(o, n, S3_MAIN, use_small ? 0 : f - 1);
                Py_DECREF(n);
                continue;
            }
            if (PySet_Add(it->offered, (PyObject *)n) < 0)
                return NULL;
            it->pending = (NodeObject *)Py_NewRef(n);
            it->pending_q = q;
            return Py_NewRef(n);
        }
        PyObject *a = s3_queue_list(o, S3_SMALL), *b = a ? s3_queue_list(o, S3_MAIN) : NULL;
        if (b == NULL) {
            Py_XDECREF(a);
            return NULL;
        }
        it->tail = PySequence_Concat(a, b);
        Py_DECREF(a);
        Py_DECREF(b);
        if (it->tail == NULL)
            return NULL;
        it->at = 0;
    }
    while (it->at < PyList_GET_SIZE(it->tail)) {
        PyObject *n = PyList_GET_ITEM(it->tail, it->at++);
        int seen = PySet_Contains(it->offered, n);
        if (seen < 0)
            return NULL;
        if (!seen) {
            if (PySet_Add(it->offered, n) < 0)
                return NULL;
            return Py_NewRef(n);
        }
    }
    Py_CLEAR(it->policy);  /* exhausted */
    return NULL;
}

static PyTypeObject S3ScanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.S3FIFOScan",
    .tp_doc = "LinkedS3FIFO.candidates' iterator.",
    .tp_basicsize = sizeof(S3ScanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)S3Scan_dealloc,
    .tp_traverse = (traverseproc)S3Scan_traverse,
    .tp_clear = (inquiry)S3Scan_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)S3Scan_next,
};
