/* LinkedBuckets: length-aware and LFU orders, buckets of nodes by rank.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* --------------------------------------------------------- LinkedBuckets */

/* An order of one tier's unreferenced copies by an integer rank, lowest first,
 * first in first out within a rank: buckets of nodes linked through the same
 * per-tier links as LinkedLRU (a tier has one policy, so one order per link),
 * kept in an array sorted by rank. The rank is read off the node, so it is
 * the same whenever the node is looked up again (hits change only while it is
 * referenced, out of the order); it is also kept in the node (``rank[t]``).
 *
 * Kinds: BUCKETS_LENGTH, Mooncake's length-aware cache (kvflow.ranked.LengthAware):
 * fewest hits first, then the deepest block, then the oldest; BUCKETS_LFU, kvflow's
 * LFU (kvflow.policy.LFU): fewest hits, then the oldest, and ``pop_front`` takes
 * from the lowest bucket only, as LFU's does. */
#define BUCKETS_LENGTH 0
#define BUCKETS_LFU 1
#define DEPTH_BITS 20

typedef struct {
    PyObject_HEAD
    int tier, kind;
    Bucket *b;            /* sorted by rank; none empty */
    Py_ssize_t nb, cap;
    Py_ssize_t size;
} BucketsObject;

static PyTypeObject BucketsType;

static long long
bk_rank(BucketsObject *o, NodeObject *n)
{
    if (o->kind == BUCKETS_LFU)
        return (long long)n->hits;
    return ((long long)n->hits << DEPTH_BITS) - (long long)n->depth;
}

/* Link ``n`` at the end (or front) of its bucket; takes its own reference. */
static int
bk_link(BucketsObject *o, NodeObject *n, int front)
{
    int t = o->tier;
    long long rank = bk_rank(o, n);
    Py_ssize_t i = bucket_get(&o->b, &o->nb, &o->cap, rank);
    if (i < 0)
        return -1;
    Bucket *b = &o->b[i];
    Py_INCREF(n);
    n->rank[t] = rank;
    if (front)
        list_push_front(&b->head, &b->tail, n, t);
    else
        list_push_back(&b->head, &b->tail, n, t);
    b->size++;
    o->size++;
    return 0;
}

/* Unlink a linked node; the caller inherits the order's reference. */
static void
bk_unlink(BucketsObject *o, NodeObject *n)
{
    int t = o->tier;
    Py_ssize_t i = bucket_find(o->b, o->nb, n->rank[t]);
    Bucket *b = &o->b[i];  /* (a linked node's bucket exists) */
    list_unlink(&b->head, &b->tail, n, t);
    o->size--;
    b->size--;
    if (b->head == NULL) {
        memmove(o->b + i, o->b + i + 1, (o->nb - i - 1) * sizeof(Bucket));
        o->nb--;
    }
}

static PyObject *
Buckets_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "kind", NULL};
    int tier, kind = BUCKETS_LENGTH;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|i:LinkedBuckets", kwlist, &tier, &kind))
        return NULL;
    if (check_tier(tier) < 0)
        return NULL;
    if (kind != BUCKETS_LENGTH && kind != BUCKETS_LFU) {
        PyErr_Format(PyExc_ValueError, "unknown LinkedBuckets kind %d", kind);
        return NULL;
    }
    BucketsObject *o = (BucketsObject *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->tier = tier;
    o->kind = kind;
    o->b = NULL;
    o->nb = o->cap = o->size = 0;
    return (PyObject *)o;
}

static int
Buckets_traverse(BucketsObject *o, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < o->nb; i++)
        for (NodeObject *n = o->b[i].head; n; n = n->next[o->tier])
            Py_VISIT(n);
    return 0;
}

static int
Buckets_clear(BucketsObject *o)
{
    while (o->nb) {
        NodeObject *n = o->b[0].head;
        bk_unlink(o, n);
        Py_DECREF(n);
    }
    return 0;
}

static void
Buckets_dealloc(BucketsObject *o)
{
    PyObject_GC_UnTrack(o);
    Buckets_clear(o);
    PyMem_Free(o->b);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *
Buckets_insert(BucketsObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (n->ref == 0 && !LINKED(o, n) && bk_link(o, n, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Buckets_remove(BucketsObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (LINKED(o, n)) {
        bk_unlink(o, n);
        Py_DECREF(n);
    }
    Py_RETURN_NONE;
}

static PyObject *
Buckets_ref(BucketsObject *o, PyObject *arg)
{
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
    bk_unlink(o, n);
    Py_DECREF(n);
    Py_RETURN_NONE;
}

static PyObject *
Buckets_unref(BucketsObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!LINKED(o, n) && bk_link(o, n, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Buckets_unref_all(BucketsObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "unref_all takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        if (!LINKED(o, n) && bk_link(o, n, 0) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Buckets_first(BucketsObject *o, PyObject *unused)
{
    return Py_NewRef(o->nb ? (PyObject *)o->b[0].head : Py_None);
}

static PyObject *
Buckets_pop_front(BucketsObject *o, PyObject *arg)
{
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t avail = o->size;
    if (o->kind == BUCKETS_LFU && o->nb)  /* the lowest bucket's only */
        avail = o->b[0].size;
    if (k > avail)
        k = avail;
    if (k < 0)
        k = 0;
    PyObject *out = PyList_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        NodeObject *n = o->b[0].head;
        bk_unlink(o, n);
        PyList_SET_ITEM(out, i, (PyObject *)n);  /* the list's reference moves over */
    }
    return out;
}

static PyObject *
Buckets_push_front(BucketsObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "push_front takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = len - 1; i >= 0; i--) {
        NodeObject *n = (NodeObject *)items[i];
        if (LINKED(o, n)) {
            bk_unlink(o, n);
            Py_DECREF(n);
        }
        if (bk_link(o, n, 1) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Buckets_move_to_end(BucketsObject *o, PyObject *arg)
{
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
    bk_unlink(o, n);
    int r = bk_link(o, n, 0);
    Py_DECREF(n);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Buckets_holds(BucketsObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    return PyBool_FromLong(LINKED(o, (NodeObject *)arg));
}

static PyObject *
bk_as_list(BucketsObject *o)
{
    PyObject *out = PyList_New(o->size);
    if (out == NULL)
        return NULL;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < o->nb; i++)
        for (NodeObject *n = o->b[i].head; n; n = n->next[o->tier])
            PyList_SET_ITEM(out, j++, Py_NewRef(n));
    return out;
}

static PyObject *
Buckets_tracked(BucketsObject *o, PyObject *unused)
{
    PyObject *l = bk_as_list(o);
    if (l == NULL)
        return NULL;
    PyObject *s = PySet_New(l);
    Py_DECREF(l);
    return s;
}

static PyObject *
Buckets_ranks(BucketsObject *o, PyObject *unused)
{
    PyObject *out = PyList_New(o->nb);
    for (Py_ssize_t i = 0; out && i < o->nb; i++) {
        PyObject *r = PyLong_FromLongLong(o->b[i].rank);
        if (r == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, r);
    }
    return out;
}

static PyObject *
Buckets_iter(BucketsObject *o)
{
    PyObject *l = bk_as_list(o);
    if (l == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(l);
    Py_DECREF(l);
    return it;
}

static Py_ssize_t
Buckets_len(BucketsObject *o)
{
    return o->size;
}

static PyObject *
Buckets_get_tier(BucketsObject *o, void *c)
{
    return PyLong_FromLong(o->tier);
}

static PyObject *
Buckets_get_kind(BucketsObject *o, void *c)
{
    return PyLong_FromLong(o->kind);
}

static PyMethodDef Buckets_methods[] = {
    {"insert", (PyCFunction)Buckets_insert, METH_O, "Order a ready copy (if unreferenced)."},
    {"remove", (PyCFunction)Buckets_remove, METH_O, "Forget a copy (if ordered)."},
    {"ref", (PyCFunction)Buckets_ref, METH_O, "The node's reference count left 0: unorder it."},
    {"unref", (PyCFunction)Buckets_unref, METH_O, "The node's reference count reached 0."},
    {"unref_all", (PyCFunction)Buckets_unref_all, METH_O, "unref each, in order."},
    {"first", (PyCFunction)Buckets_first, METH_NOARGS, "The first candidate, in O(1)."},
    {"pop_front", (PyCFunction)Buckets_pop_front, METH_O, "Remove and return the first k."},
    {"push_front", (PyCFunction)Buckets_push_front, METH_O,
     "Undo pop_front for these nodes: each to the front of its bucket."},
    {"move_to_end", (PyCFunction)Buckets_move_to_end, METH_O,
     "Move an ordered node behind the rest of its bucket."},
    {"holds", (PyCFunction)Buckets_holds, METH_O, "Whether the node is ordered here."},
    {"tracked", (PyCFunction)Buckets_tracked, METH_NOARGS, "The ordered nodes, as a set."},
    {"ranks", (PyCFunction)Buckets_ranks, METH_NOARGS, "The buckets' ranks, lowest first."},
    {NULL},
};

static PyGetSetDef Buckets_getset[] = {
    {"tier", (getter)Buckets_get_tier, NULL, NULL, NULL},
    {"kind", (getter)Buckets_get_kind, NULL, NULL, NULL},
    {NULL},
};

static PySequenceMethods Buckets_as_sequence = {
    .sq_length = (lenfunc)Buckets_len,
};

static PyTypeObject BucketsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.LinkedBuckets",
    .tp_doc = "One tier's unreferenced copies in buckets by rank, linked through the nodes.",
    .tp_basicsize = sizeof(BucketsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = Buckets_tp_new,
    .tp_dealloc = (destructor)Buckets_dealloc,
    .tp_traverse = (traverseproc)Buckets_traverse,
    .tp_clear = (inquiry)Buckets_clear,
    .tp_iter = (getiterfunc)Buckets_iter,
    .tp_as_sequence = &Buckets_as_sequence,
    .tp_methods = Buckets_methods,
    .tp_getset = Buckets_getset,
};
