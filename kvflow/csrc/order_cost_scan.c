/* LinkedCost.candidates' scan (CostScan).
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

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
