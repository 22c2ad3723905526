/* LinkedCost: CostAware's (GDSF) buckets linked through the nodes.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* ------------------------------------------------------------ LinkedCost */

/* kvflow.ranked.CostAware (GDSF over what a block saves) with its buckets linked
 * through the nodes: buckets by integer rank in a sorted array (as LinkedBuckets),
 * first in first out within one, each node's rank and route tag packed in its
 * ``rank[t]`` (rank << 2 | route + 1). Every rank is computed by the same double
 * expressions, in the same order, as CostAware's, so the same blocks go. The
 * Python class costs ~4x LRU's time in cache mode: a rank per released block and a
 * route check per victim in the interpreter. ``bind`` and the constants (from the
 * cost model) come from Python (kvflow.ranked.LinkedCostAware). */

typedef struct {
    PyObject_HEAD
    int tier;
    Py_ssize_t capacity;
    Bucket *b;              /* sorted by rank; none empty */
    Py_ssize_t nb, cap, size;
    double clock, clock_before;
    double load_worth[3], re0, re1;
    int lower[2], nlower, checks_tags;
    PyObject *above;        /* the tier above's LinkedCost, told of our copies, or NULL */
    NodeObject *last;       /* the node placed last (by place), and its rank */
    double last_rank;
    /* The last pop_front's victims: node (borrowed: the caller holds them), rank, tag. */
    NodeObject **pn;
    long long *pr;
    int *pt;
    Py_ssize_t np, pcap;
} CostObject;

static PyTypeObject CostType, CostScanType;

#define CO_RANK(o, n) ((n)->rank[(o)->tier] >> 2)
#define CO_TAG(o, n) ((int)((n)->rank[(o)->tier] & 3) - 1)

static int
co_link(CostObject *o, NodeObject *n, long long rank, int tag, int front)
{
    int t = o->tier;
    Py_ssize_t i = bucket_get(&o->b, &o->nb, &o->cap, rank);
    if (i < 0)
        return -1;
    Bucket *b = &o->b[i];
    Py_INCREF(n);
    n->rank[t] = (rank << 2) | (long long)(tag + 1);
    if (front)
        list_push_front(&b->head, &b->tail, n, t);
    else
        list_push_back(&b->head, &b->tail, n, t);
    b->size++;
    o->size++;
    return 0;
}

/* Unlink a linked node; the caller inherits the order's reference. A bucket left
 * empty stays (CostAware drops empty buckets only when they come first, in
 * ``first`` and ``pop_front``; a scan's ranks include the empty ones). */
static void
co_unlink(CostObject *o, NodeObject *n)
{
    int t = o->tier;
    Py_ssize_t i = bucket_find(o->b, o->nb, CO_RANK(o, n));
    Bucket *b = &o->b[i];
    list_unlink(&b->head, &b->tail, n, t);
    o->size--;
    b->size--;
}

/* Drop empty buckets that come first (CostAware._front). */
static void
co_clean_front(CostObject *o)
{
    Py_ssize_t i = 0;
    while (i < o->nb && o->b[i].size == 0)
        i++;
    if (i) {
        memmove(o->b, o->b + i, (o->nb - i) * sizeof(Bucket));
        o->nb -= i;
    }
}

/* CostAware._route: the tier a lost copy would come back from, or -1. */
static int
co_route(CostObject *o, NodeObject *n)
{
    for (int j = 0; j < o->nlower; j++) {
        int s = n->state[o->lower[j]];
        if (s == READY || s == FILLING)
            return o->lower[j];
    }
    return -1;
}

/* CostAware._place. Returns 0, or -1 on an error. */
static int
co_place(CostObject *o, NodeObject *n, double floor)
{
    int route = co_route(o, n);
    double worth = route < 0 ? o->re0 + o->re1 * (double)n->depth : o->load_worth[route];
    double rank = o->clock + (double)(n->hits + 1) * (worth > 0.0 ? worth : 0.0);
    if (o->last != NULL && o->last->parent == n && o->last_rank > rank)
        rank = o->last_rank;  /* copies land tail-first too: the child placed just before */
    if (rank < floor)
        rank = floor;
    if (co_link(o, n, (long long)rank, route, 0) < 0)
        return -1;
    Py_INCREF(n);
    Py_XSETREF(o->last, n);
    o->last_rank = rank;
    return 0;
}

static PyObject *
Cost_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "capacity", "load1", "load2", "re0", "re1", "lower",
                             NULL};
    int tier;
    Py_ssize_t capacity;
    double l1, l2, re0, re1;
    PyObject *lower;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "inddddO:LinkedCost", kwlist, &tier,
                                     &capacity, &l1, &l2, &re0, &re1, &lower))
        return NULL;
    if (check_tier(tier) < 0)
        return NULL;
    CostObject *o = (CostObject *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->tier = tier;
    o->capacity = capacity;
    o->load_worth[0] = 0.0;
    o->load_worth[1] = l1;
    o->load_worth[2] = l2;
    o->re0 = re0;
    o->re1 = re1;
    o->checks_tags = 1;
    PyObject *r = PyObject_CallMethod((PyObject *)o, "_configure", "Oi", lower, 1);
    if (r == NULL) {
        Py_DECREF(o);
        return NULL;
    }
    Py_DECREF(r);
    return (PyObject *)o;
}

static PyObject *
Cost_configure(CostObject *o, PyObject *args)
{
    PyObject *lower;
    int checks;
    if (!PyArg_ParseTuple(args, "Oi:_configure", &lower, &checks))
        return NULL;
    PyObject *seq = PySequence_Fast(lower, "lower tiers: a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > 2) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "at most 2 lower tiers");
        return NULL;
    }
    int tiers[2] = {0, 0};
    for (Py_ssize_t i = 0; i < len; i++) {
        long t = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((t == -1 && PyErr_Occurred()) || t <= o->tier || t >= NTIERS) {
            Py_DECREF(seq);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "lower tier %ld below tier %d?", t, o->tier);
            return NULL;
        }
        tiers[i] = (int)t;
    }
    Py_DECREF(seq);
    o->lower[0] = tiers[0];
    o->lower[1] = tiers[1];
    o->nlower = (int)len;
    o->checks_tags = checks;
    Py_RETURN_NONE;
}

static PyObject *
Cost_set_above(CostObject *o, PyObject *arg)
{
    if (arg != Py_None && !PyObject_TypeCheck(arg, &CostType)) {
        PyErr_SetString(PyExc_TypeError, "the tier above's policy must be a LinkedCost");
        return NULL;
    }
    Py_XSETREF(o->above, arg == Py_None ? NULL : Py_NewRef(arg));
    Py_RETURN_NONE;
}

static int
Cost_traverse(CostObject *o, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < o->nb; i++)
        for (NodeObject *n = o->b[i].head; n; n = n->next[o->tier])
            Py_VISIT(n);
    Py_VISIT(o->above);
    Py_VISIT(o->last);
    return 0;
}

static int
Cost_clear(CostObject *o)
{
    for (Py_ssize_t i = 0; i < o->nb; i++)
        while (o->b[i].head) {
            NodeObject *n = o->b[i].head;
            co_unlink(o, n);
            Py_DECREF(n);
        }
    o->nb = 0;
    Py_CLEAR(o->above);
    Py_CLEAR(o->last);
    o->np = 0;
    return 0;
}

static void
Cost_dealloc(CostObject *o)
{
    PyObject_GC_UnTrack(o);
    Cost_clear(o);
    PyMem_Free(o->b);
    PyMem_Free(o->pn);
    PyMem_Free(o->pr);
    PyMem_Free(o->pt);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static int
co_remove(CostObject *o, NodeObject *n)
{
    if (LINKED(o, n)) {
        co_unlink(o, n);
        Py_DECREF(n);
    }
    return 0;
}

static PyObject *
Cost_insert(CostObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (n->ref == 0 && co_place(o, n, 0.0) < 0)
        return NULL;
    CostObject *above = (CostObject *)o->above;
    if (above != NULL && LINKED(above, n)) {  /* a cheaper route back: worth less there */
        co_remove(above, n);
        if (co_place(above, n, 0.0) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Cost_unref(CostObject *o, PyObject *arg)
{
    if (node_check(arg) < 0 || co_place(o, (NodeObject *)arg, 0.0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* CostAware.unref_all: a release's blocks, tail-first; a parent ranks no lower than
 * the child released just before it (``last`` is not used nor set here). */
static PyObject *
Cost_unref_all(CostObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "unref_all takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    NodeObject *prev = NULL;
    double rank = 0.0;
    int route = -1;
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        if (o->nlower)
            route = co_route(o, n);
        double worth = route < 0 ? o->re0 + o->re1 * (double)n->depth : o->load_worth[route];
        double x = o->clock + (double)(n->hits + 1) * (worth > 0.0 ? worth : 0.0);
        if (prev != NULL && prev->parent == n && rank > x)
            x = rank;
        if (co_link(o, n, (long long)x, route, 0) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        prev = n;
        rank = x;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Cost_remove(CostObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    co_remove(o, (NodeObject *)arg);
    Py_RETURN_NONE;
}

static PyObject *
Cost_ref(CostObject *o, PyObject *arg)
{
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
    co_unlink(o, n);
    Py_DECREF(n);
    Py_RETURN_NONE;
}

static PyObject *
Cost_tracked(CostObject *o, PyObject *unused)
{
    PyObject *s = PySet_New(NULL);
    for (Py_ssize_t i = 0; s && i < o->nb; i++)
        if (list_add_to_set(s, o->b[i].head, o->tier) < 0)
            Py_CLEAR(s);
    return s;
}

/* [(rank, [(node, tag), ...]), ...], lowest rank first: what CostAware keeps. */
static PyObject *
Cost_buckets(CostObject *o, PyObject *unused)
{
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < o->nb; i++) {
        if (!o->b[i].size)
            continue;
        PyObject *l = PyList_New(0);
        for (NodeObject *n = o->b[i].head; l && n; n = n->next[o->tier]) {
            PyObject *e = Py_BuildValue("(Oi)", (PyObject *)n, CO_TAG(o, n));
            if (e == NULL || PyList_Append(l, e) < 0)
                Py_CLEAR(l);
            Py_XDECREF(e);
        }
        PyObject *e = l ? Py_BuildValue("(LO)", o->b[i].rank, l) : NULL;
        Py_XDECREF(l);
        if (e == NULL || PyList_Append(out, e) < 0)
            Py_CLEAR(out);
        Py_XDECREF(e);
    }
    return out;
}

/* In order_cost_evict.c (included next). */
static PyObject *Cost_first(CostObject *o, PyObject *unused);
static PyObject *Cost_pop_front(CostObject *o, PyObject *arg);
static PyObject *Cost_push_front(CostObject *o, PyObject *arg);
static PyObject *Cost_candidates(CostObject *o, PyObject *unused);

static Py_ssize_t
Cost_len(CostObject *o)
{
    return o->size;
}

static PyObject *
Cost_get(CostObject *o, void *which)
{
    switch ((int)(intptr_t)which) {
    case 0: return PyLong_FromLong(o->tier);
    case 1: return PyLong_FromSsize_t(o->capacity);
    case 2: return PyFloat_FromDouble(o->clock);
    case 3: return PyBool_FromLong(o->checks_tags);
    case 4: {
        PyObject *t = PyTuple_New(o->nlower);
        for (int j = 0; t && j < o->nlower; j++)
            PyTuple_SET_ITEM(t, j, PyLong_FromLong(o->lower[j]));
        return t;
    }
    default: return Py_NewRef(o->above ? o->above : Py_None);
    }
}

static PyMethodDef Cost_methods[] = {
    {"insert", (PyCFunction)Cost_insert, METH_O, "A ready copy: ranked (and above, again)."},
    {"remove", (PyCFunction)Cost_remove, METH_O, "Forget a copy (if ranked)."},
    {"ref", (PyCFunction)Cost_ref, METH_O, "The node's reference count left 0: unrank it."},
    {"unref", (PyCFunction)Cost_unref, METH_O, "The node's reference count reached 0."},
    {"unref_all", (PyCFunction)Cost_unref_all, METH_O, "A release's blocks, tail-first."},
    {"first", (PyCFunction)Cost_first, METH_NOARGS, "The first candidate (stale ones ranked "
     "again on the way)."},
    {"pop_front", (PyCFunction)Cost_pop_front, METH_O, "Remove and return up to k victims."},
    {"push_front", (PyCFunction)Cost_push_front, METH_O, "Undo the last pop_front for these."},
    {"candidates", (PyCFunction)Cost_candidates, METH_NOARGS, "Every node once, lowest first."},
    {"tracked", (PyCFunction)Cost_tracked, METH_NOARGS, "The ranked nodes, as a set."},
    {"buckets", (PyCFunction)Cost_buckets, METH_NOARGS, "[(rank, [(node, tag)...])...]."},
    {"_configure", (PyCFunction)Cost_configure, METH_VARARGS, "(lower tiers, checks tags)."},
    {"_set_above", (PyCFunction)Cost_set_above, METH_O, "The tier above's policy."},
    {NULL},
};

static PyGetSetDef Cost_getset[] = {
    {"tier", (getter)Cost_get, NULL, NULL, (void *)0},
    {"capacity", (getter)Cost_get, NULL, NULL, (void *)1},
    {"clock", (getter)Cost_get, NULL, NULL, (void *)2},
    {"checks_tags", (getter)Cost_get, NULL, NULL, (void *)3},
    {"_lower", (getter)Cost_get, NULL, NULL, (void *)4},
    {"_above", (getter)Cost_get, NULL, NULL, (void *)5},
    {NULL},
};

static PySequenceMethods Cost_as_sequence = {
    .sq_length = (lenfunc)Cost_len,
};

static PyTypeObject CostType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.LinkedCost",
    .tp_doc = "CostAware over one tier's unreferenced copies, linked through the nodes.",
    .tp_basicsize = sizeof(CostObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = Cost_tp_new,
    .tp_dealloc = (destructor)Cost_dealloc,
    .tp_traverse = (traverseproc)Cost_traverse,
    .tp_clear = (inquiry)Cost_clear,
    .tp_as_sequence = &Cost_as_sequence,
    .tp_methods = Cost_methods,
    .tp_getset = Cost_getset,
};
