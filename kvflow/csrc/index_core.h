/* What every part of kvflow._index_core shares: the copy states, the interned
 * names, the node's layout and the intrusive lists the native orders link
 * through the nodes.
 *
 * The extension is one translation unit (kvflow/_index_core.c includes this
 * header, then each part in dependency order), so the statics below are
 * defined once and the helpers inline exactly as they did when the parts
 * were one file. A part is not compiled on its own. */
#ifndef KVFLOW_INDEX_CORE_H
#define KVFLOW_INDEX_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>

/* Copy states: must equal kvflow.index_core's (checked at import). */
#define ABSENT 0
#define READY 1
#define FILLING 2
#define COMPUTING 3
#define NTIERS 3
#define USABLE(s) ((s) == READY || (s) == FILLING)

static PyObject *NO_INFLIGHT;  /* kvflow.index_core.NO_INFLIGHT */
static PyObject *STATE_NAMES;  /* kvflow.index_core.STATE_NAMES */
static PyObject *TIER_NAMES;   /* kvflow.index_core.TIER_NAMES */
static PyObject *s_remove, *s_first, *s_candidates;
static PyObject *s_ref, *s_insert, *s_unref_all, *s_pop_front, *s_push_front,
    *s_orders_referenced, *s_popitem;


/* ------------------------------------------------------------------ Node */

typedef struct NodeObject {
    PyObject_HEAD
    PyObject *key;
    struct NodeObject *parent;  /* NULL: a root block */
    PyObject *inflight;         /* NULL: no op ever (reads as NO_INFLIGHT) */
    Py_ssize_t depth, children, ref, hits, last_access;
    long loc[NTIERS];
    int state[NTIERS];
    /* Links of the native order (LinkedLRU, LinkedBuckets, LinkedARC, LinkedS3FIFO,
     * LinkedCost) of this node's copy on each tier, and its rank or place there
     * (each order says what it keeps in it). */
    struct NodeObject *prev[NTIERS], *next[NTIERS];
    long long rank[NTIERS];
    unsigned char linked;       /* bit t: on tier t's native order */
} NodeObject;

static PyTypeObject NodeType;
static PyTypeObject TripleType;

/* Whether ``n`` is on the order ``o`` (any object with an int ``tier``). */
#define LINKED(o, n) (((n)->linked >> (o)->tier) & 1)

/* A native order's tier argument, checked; -1 with ValueError if out of range. */
static inline int
check_tier(int tier)
{
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------- intrusive node lists */

/* A list of nodes through their tier-t links (prev[t], next[t]): the orders
 * keep one or more, each as a head and a tail pointer. The helpers move links
 * and the node's ``linked`` bit only; references, sizes and ranks are the
 * caller's. */
typedef struct {
    NodeObject *head, *tail;
    Py_ssize_t size;
} NodeList;

/* Link ``n`` last. */
static inline void
list_push_back(NodeObject **head, NodeObject **tail, NodeObject *n, int t)
{
    n->linked |= 1 << t;
    n->next[t] = NULL;
    n->prev[t] = *tail;
    if (*tail)
        (*tail)->next[t] = n;
    else
        *head = n;
    *tail = n;
}

/* Link ``n`` first. */
static inline void
list_push_front(NodeObject **head, NodeObject **tail, NodeObject *n, int t)
{
    n->linked |= 1 << t;
    n->prev[t] = NULL;
    n->next[t] = *head;
    if (*head)
        (*head)->prev[t] = n;
    else
        *tail = n;
    *head = n;
}

/* Unlink ``n``, which is on the list. */
static inline void
list_unlink(NodeObject **head, NodeObject **tail, NodeObject *n, int t)
{
    if (n->prev[t])
        n->prev[t]->next[t] = n->next[t];
    else
        *head = n->next[t];
    if (n->next[t])
        n->next[t]->prev[t] = n->prev[t];
    else
        *tail = n->prev[t];
    n->prev[t] = n->next[t] = NULL;
    n->linked &= ~(1 << t);
}

/* The list's ``size`` nodes, first to last, as a new Python list. */
static inline PyObject *
list_as_pylist(NodeObject *head, Py_ssize_t size, int t)
{
    PyObject *out = PyList_New(size);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (NodeObject *n = head; n; n = n->next[t])
        PyList_SET_ITEM(out, i++, Py_NewRef(n));
    return out;
}

/* Add the list's nodes to the set ``s``; 0, or -1 on an error. */
static inline int
list_add_to_set(PyObject *s, NodeObject *head, int t)
{
    for (NodeObject *n = head; n; n = n->next[t])
        if (PySet_Add(s, (PyObject *)n) < 0)
            return -1;
    return 0;
}

/* ------------------------------------------------------------- buckets */

/* One rank's nodes, first in first out (LinkedBuckets, LinkedCost): an array of
 * these sorted by rank is an order by rank. */
typedef struct {
    long long rank;
    NodeObject *head, *tail;
    Py_ssize_t size;
} Bucket;

/* Index of the first of ``nb`` buckets whose rank is >= ``rank``. */
static inline Py_ssize_t
bucket_find(const Bucket *b, Py_ssize_t nb, long long rank)
{
    Py_ssize_t lo = 0, hi = nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (b[mid].rank < rank)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Index of the bucket of ``rank`` in ``*b`` (``*nb`` of them, room for ``*cap``),
 * made empty in place if missing (the array grows as needed); -1 on no memory. */
static inline Py_ssize_t
bucket_get(Bucket **b, Py_ssize_t *nb, Py_ssize_t *cap, long long rank)
{
    Py_ssize_t i = bucket_find(*b, *nb, rank);
    if (i < *nb && (*b)[i].rank == rank)
        return i;
    if (*nb == *cap) {
        Py_ssize_t grown = *cap ? 2 * *cap : 16;
        Bucket *nbk = PyMem_Realloc(*b, grown * sizeof(Bucket));
        if (nbk == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *b = nbk;
        *cap = grown;
    }
    memmove(*b + i + 1, *b + i, (*nb - i) * sizeof(Bucket));
    (*b)[i].rank = rank;
    (*b)[i].head = (*b)[i].tail = NULL;
    (*b)[i].size = 0;
    (*nb)++;
    return i;
}

#endif /* KVFLOW_INDEX_CORE_H */
