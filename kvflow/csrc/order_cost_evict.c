/* LinkedCost's eviction side: first, pop_front, push_front and the candidates scan.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

static PyObject *
Cost_first(CostObject *o, PyObject *unused)
{
    for (;;) {
        co_clean_front(o);
        if (!o->nb)
            break;
        NodeObject *n = o->b[0].head;
        if (!o->checks_tags || CO_TAG(o, n) == co_route(o, n))
            return Py_NewRef(n);
        Py_INCREF(n);  /* stale: ranked again */
        co_unlink(o, n);
        Py_DECREF(n);
        int r = co_place(o, n, 0.0);
        Py_DECREF(n);
        if (r < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static int
co_popped_room(CostObject *o)
{
    if (o->np < o->pcap)
        return 0;
    Py_ssize_t cap = o->pcap ? 2 * o->pcap : 64;
    NodeObject **pn = PyMem_Realloc(o->pn, cap * sizeof(NodeObject *));
    if (pn == NULL)
        goto nomem;
    o->pn = pn;
    long long *pr = PyMem_Realloc(o->pr, cap * sizeof(long long));
    if (pr == NULL)
        goto nomem;
    o->pr = pr;
    int *pt = PyMem_Realloc(o->pt, cap * sizeof(int));
    if (pt == NULL)
        goto nomem;
    o->pt = pt;
    o->pcap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static PyObject *
Cost_pop_front(CostObject *o, PyObject *arg)
{
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    o->clock_before = o->clock;
    o->np = 0;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    while (PyList_GET_SIZE(out) < k) {
        co_clean_front(o);
        if (!o->nb)
            break;
        long long r = o->b[0].rank;
        Py_ssize_t batch = k - PyList_GET_SIZE(out);
        if (batch > o->b[0].size)
            batch = o->b[0].size;
        /* CostAware takes a snapshot of the bucket's first ``batch``; a block ranked
         * again lands behind them (or elsewhere), so they are its first ``batch`` still. */
        for (Py_ssize_t j = 0; j < batch; j++) {
            Py_ssize_t i = bucket_find(o->b, o->nb, r);
            NodeObject *n = o->b[i].head;
            int tag = CO_TAG(o, n);
            co_unlink(o, n);  /* the order's reference is ours now */
            if (o->checks_tags && tag != co_route(o, n)) {
                int rr = co_place(o, n, 0.0);  /* its route back changed: ranked again */
                Py_DECREF(n);
                if (rr < 0) {
                    Py_DECREF(out);
                    return NULL;
                }
                continue;
            }
            if (co_popped_room(o) < 0 || PyList_Append(out, (PyObject *)n) < 0) {
                Py_DECREF(n);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(n);  /* the list holds it */
            o->pn[o->np] = n;
            o->pr[o->np] = r;
            o->pt[o->np++] = tag;
            if ((double)r > o->clock)
                o->clock = (double)r;
        }
    }
    return out;
}

static PyObject *
Cost_push_front(CostObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "push_front takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = len - 1; i >= 0; i--) {
        NodeObject *n = (NodeObject *)items[i];
        Py_ssize_t j = o->np - 1;
        while (j >= 0 && o->pn[j] != n)
            j--;
        if (j < 0) {
            Py_DECREF(seq);
            PyErr_SetObject(PyExc_KeyError, (PyObject *)n);
            return NULL;
        }
        if (LINKED(o, n)) {
            co_unlink(o, n);
            Py_DECREF(n);
        }
        if (co_link(o, n, o->pr[j], o->pt[j], 1) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        /* forget it (CostAware's popped.pop(node)) */
        memmove(o->pn + j, o->pn + j + 1, (o->np - j - 1) * sizeof(NodeObject *));
        memmove(o->pr + j, o->pr + j + 1, (o->np - j - 1) * sizeof(long long));
        memmove(o->pt + j, o->pt + j + 1, (o->np - j - 1) * sizeof(int));
        o->np--;
    }
    Py_DECREF(seq);
    o->clock = o->clock_before;  /* only the victims kept age the order */
    for (Py_ssize_t j = 0; j < o->np; j++)
        if ((double)o->pr[j] > o->clock)
            o->clock = (double)o->pr[j];
    Py_RETURN_NONE;
}

/* BucketedPolicy.candidates with CostAware's _declined and _taken. */
typedef struct {
    PyObject_HEAD
    CostObject *policy;
    long long *ranks;       /* the buckets' ranks when the scan began */
    Py_ssize_t nranks, ri;
    Py_ssize_t left;        /* steps left in the current bucket */
    int in_bucket;
    PyObject *offered;
    NodeObject *pending;
    long long pending_r;
} CostScanObject;

static PyObject *
Cost_candidates(CostObject *o, PyObject *unused)
{
    CostScanObject *it = PyObject_GC_New(CostScanObject, &CostScanType);
    if (it == NULL)
        return NULL;
    it->policy = (CostObject *)Py_NewRef(o);
    it->ranks = PyMem_Malloc((o->nb ? o->nb : 1) * sizeof(long long));
    it->nranks = o->nb;
    it->ri = 0;
    it->left = 0;
    it->in_bucket = 0;
    it->offered = PySet_New(NULL);
    it->pending = NULL;
    it->pending_r = 0;
    PyObject_GC_Track(it);
    if (it->ranks == NULL || it->offered == NULL) {
        Py_DECREF(it);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < o->nb; i++)
        it->ranks[i] = o->b[i].rank;
    return (PyObject *)it;
}

static int
CostScan_traverse(CostScanObject *it, visitproc visit, void *arg)
{
    Py_VISIT(it->policy);
    Py_VISIT(it->offered);
    Py_VISIT(it->pending);
    return 0;
}

static int
CostScan_clear(CostScanObject *it)
{
    Py_CLEAR(it->policy);
    Py_CLEAR(it->offered);
    Py_CLEAR(it->pending);
    return 0;
}

static void
CostScan_dealloc(CostScanObject *it)
{
    PyObject_GC_UnTrack(it);
    CostScan_clear(it);
    PyMem_Free(it->ranks);
    PyObject_GC_Del(it);
}

/* The bucket of ``rank`` now, or NULL. */
static Bucket *
co_bucket(CostObject *o, long long rank)
{
    Py_ssize_t i = bucket_find(o->b, o->nb, rank);
    return i < o->nb && o->b[i].rank == rank ? &o->b[i] : NULL;
}

static PyObject *
CostScan_next(CostScanObject *it)
{
    CostObject *o = it->policy;
    if (o == NULL)
        return NULL;
    if (it->pending) {
        NodeObject *n = it->pending;
        long long r = it->pending_r;
        it->pending = NULL;
        if (LINKED(o, n) && CO_RANK(o, n) == r) {
            /* declined (a parent pinned by its children): ranked again behind this
             * bucket (GDSF's "used now" rank, at least), as LRU moves it to its end */
            co_unlink(o, n);
            Py_DECREF(n);  /* the order's reference */
            if (co_place(o, n, (double)(r + 1)) < 0) {
                Py_DECREF(n);
                return NULL;
            }
        }
        else if ((double)r > o->clock) {  /* taken */
            o->clock = (double)r;
        }
        Py_DECREF(n);
    }
    for (;;) {
        if (!it->in_bucket) {
            if (it->ri >= it->nranks)
                break;
            Bucket *b = co_bucket(o, it->ranks[it->ri]);
            it->left = b ? b->size : 0;
            it->in_bucket = 1;
        }
        long long r = it->ranks[it->ri];
        if (it->left <= 0) {
            it->in_bucket = 0;
            it->ri++;
            continue;
        }
        it->left--;
        Bucket *b = co_bucket(o, r);
        NodeObject *n = b ? b->head : NULL;
        int seen = n ? PySet_Contains(it->offered, (PyObject *)n) : 0;
        if (seen < 0)
            return NULL;
        if (n == NULL || seen) {
            it->in_bucket = 0;
            it->ri++;
            continue;
        }
        if (PySet_Add(it->offered, (PyObject *)n) < 0)
            return NULL;
        it->pending = (NodeObject *)Py_NewRef(n);
        it->pending_r = r;
        return Py_NewRef(n);
    }
    Py_CLEAR(it->policy);
    return NULL;
}

static PyTypeObject CostScanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.CostScan",
    .tp_doc = "LinkedCost.candidates' iterator.",
    .tp_basicsize = sizeof(CostScanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)CostScan_dealloc,
    .tp_traverse = (traverseproc)CostScan_traverse,
    .tp_clear = (inquiry)CostScan_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)CostScan_next,
};
