/* The prefix index's per-request loops in C: nodes as C structs, an intrusive LRU.
 *
 * Why native: every block of every request passes through match, ref, add,
 * commit, release and eviction, and the benchmark target (bench_index.py:
 * within 3x of a bare OrderedDict LRU) is out of reach for any per-block
 * Python object (benchmarks/RESULTS.md, issue 2). This module implements
 * exactly the API of kvflow/index_core.py, the pure-Python reference, which
 * stays the fallback where no compiler ran and the oracle the tests compare
 * this against.
 *
 * Ownership: the index's dict owns its nodes; a node owns its key, its parent
 * and its in-flight op list; a LinkedLRU owns one reference to every node on
 * its list (links themselves are borrowed pointers inside the nodes).
 */
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
    *s_orders_referenced;

/* ------------------------------------------------------------------ Node */

typedef struct NodeObject {
    PyObject_HEAD
    PyObject *key;
    struct NodeObject *parent;  /* NULL: a root block */
    PyObject *inflight;         /* NULL: no op ever (reads as NO_INFLIGHT) */
    Py_ssize_t depth, children, ref, hits, last_access;
    long loc[NTIERS];
    int state[NTIERS];
    /* Links of the native order (LinkedLRU, LinkedBuckets) of this node's copy on
     * each tier, and its rank there (LinkedBuckets). */
    struct NodeObject *prev[NTIERS], *next[NTIERS];
    long long rank[NTIERS];
    unsigned char linked;       /* bit t: on tier t's native order */
} NodeObject;

static PyTypeObject NodeType;
static PyTypeObject TripleType;

static NodeObject *
node_new_raw(PyObject *key, NodeObject *parent)
{
    NodeObject *n = PyObject_GC_New(NodeObject, &NodeType);
    if (n == NULL)
        return NULL;
    Py_INCREF(key);
    n->key = key;
    Py_XINCREF(parent);
    n->parent = parent;
    n->inflight = NULL;
    n->depth = parent == NULL ? 0 : parent->depth + 1;
    n->children = n->ref = n->hits = n->last_access = 0;
    for (int t = 0; t < NTIERS; t++) {
        n->loc[t] = -1;
        n->state[t] = ABSENT;
        n->prev[t] = n->next[t] = NULL;
        n->rank[t] = 0;
    }
    n->linked = 0;
    PyObject_GC_Track(n);
    return n;
}

static int
node_check(PyObject *o)
{
    if (Py_IS_TYPE(o, &NodeType))
        return 0;
    PyErr_Format(PyExc_TypeError, "expected a native index Node, got %.100s",
                 Py_TYPE(o)->tp_name);
    return -1;
}

/* Every item a Node; returns a new reference to a fast sequence, or NULL. */
static PyObject *
node_seq(PyObject *arg, const char *what)
{
    PyObject *seq = PySequence_Fast(arg, what);
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++)
        if (node_check(items[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    return seq;
}

static PyObject *
Node_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "parent", "device_id", "device_state", NULL};
    PyObject *key, *parent = Py_None;
    long device_id = -1;
    int device_state = ABSENT;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Oli:Node", kwlist, &key, &parent,
                                     &device_id, &device_state))
        return NULL;
    if (parent != Py_None && node_check(parent) < 0)
        return NULL;
    if (device_state < ABSENT || device_state > COMPUTING) {
        PyErr_Format(PyExc_ValueError, "device_state must be 0..3, got %d", device_state);
        return NULL;
    }
    if (PyObject_Hash(key) == -1)
        return NULL;
    NodeObject *n = node_new_raw(key, parent == Py_None ? NULL : (NodeObject *)parent);
    if (n == NULL)
        return NULL;
    n->loc[0] = device_id;
    n->state[0] = device_state;
    return (PyObject *)n;
}

static int
Node_traverse(NodeObject *n, visitproc visit, void *arg)
{
    Py_VISIT(n->key);
    Py_VISIT(n->parent);
    Py_VISIT(n->inflight);
    return 0;
}

static int
Node_clear(NodeObject *n)
{
    Py_CLEAR(n->inflight);
    Py_CLEAR(n->parent);
    Py_CLEAR(n->key);
    return 0;
}

static void
Node_dealloc(NodeObject *n)
{
    PyObject_GC_UnTrack(n);
    Py_TRASHCAN_BEGIN(n, Node_dealloc)
    Node_clear(n);
    PyObject_GC_Del(n);
    Py_TRASHCAN_END
}

static PyObject *
Node_get_key(NodeObject *n, void *c)
{
    return Py_NewRef(n->key);
}

static PyObject *
Node_get_parent(NodeObject *n, void *c)
{
    return Py_NewRef(n->parent ? (PyObject *)n->parent : Py_None);
}

static int
Node_set_parent(NodeObject *n, PyObject *v, void *c)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete parent");
        return -1;
    }
    if (v != Py_None && node_check(v) < 0)
        return -1;
    NodeObject *old = n->parent;
    n->parent = v == Py_None ? NULL : (NodeObject *)Py_NewRef(v);
    Py_XDECREF(old);
    return 0;
}

static PyObject *
Node_get_inflight(NodeObject *n, void *c)
{
    return Py_NewRef(n->inflight ? n->inflight : NO_INFLIGHT);
}

static int
Node_set_inflight(NodeObject *n, PyObject *v, void *c)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete inflight");
        return -1;
    }
    PyObject *old = n->inflight;
    n->inflight = v == NO_INFLIGHT ? NULL : Py_NewRef(v);
    Py_XDECREF(old);
    return 0;
}

/* ``loc`` and ``state`` read as small mutable sequences that write through. */
typedef struct {
    PyObject_HEAD
    NodeObject *node;
    int is_state;
} TripleObject;

static PyObject *
triple_new(NodeObject *n, int is_state)
{
    TripleObject *t = PyObject_New(TripleObject, &TripleType);
    if (t == NULL)
        return NULL;
    t->node = (NodeObject *)Py_NewRef(n);
    t->is_state = is_state;
    return (PyObject *)t;
}

static int
triple_store(NodeObject *n, int is_state, Py_ssize_t i, PyObject *v)
{
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (is_state) {
        if (x < ABSENT || x > COMPUTING) {
            PyErr_Format(PyExc_ValueError, "copy state must be 0..3, got %ld", x);
            return -1;
        }
        n->state[i] = (int)x;
    }
    else {
        n->loc[i] = x;
    }
    return 0;
}

static int
triple_assign_all(NodeObject *n, int is_state, PyObject *v)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a node's loc or state");
        return -1;
    }
    PyObject *seq = PySequence_Fast(v, "loc and state take a sequence of 3 ints");
    if (seq == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != NTIERS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "loc and state take a sequence of 3 ints");
        return -1;
    }
    NodeObject saved = *n;
    for (Py_ssize_t i = 0; i < NTIERS; i++) {
        if (triple_store(n, is_state, i, PySequence_Fast_GET_ITEM(seq, i)) < 0) {
            memcpy(n->loc, saved.loc, sizeof n->loc);  /* all or nothing */
            memcpy(n->state, saved.state, sizeof n->state);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *
Node_get_loc(NodeObject *n, void *c)
{
    return triple_new(n, 0);
}

static int
Node_set_loc(NodeObject *n, PyObject *v, void *c)
{
    return triple_assign_all(n, 0, v);
}

static PyObject *
Node_get_state(NodeObject *n, void *c)
{
    return triple_new(n, 1);
}

static int
Node_set_state(NodeObject *n, PyObject *v, void *c)
{
    return triple_assign_all(n, 1, v);
}

static int
node_matchable(NodeObject *n)
{
    if (n->state[0] == COMPUTING)
        return 0;
    for (int t = 0; t < NTIERS; t++)
        if (USABLE(n->state[t]))
            return 1;
    return 0;
}

static int
node_best_tier(NodeObject *n)
{
    if (n->state[0] == COMPUTING)
        return -1;
    for (int t = 0; t < NTIERS; t++)
        if (USABLE(n->state[t]))
            return t;
    return -1;
}

static PyObject *
Node_get_matchable(NodeObject *n, void *c)
{
    return PyBool_FromLong(node_matchable(n));
}

static PyObject *
Node_best_tier(NodeObject *n, PyObject *unused)
{
    return PyLong_FromLong(node_best_tier(n));
}

static PyObject *
Node_repr(NodeObject *n)
{
    PyObject *parts = PyList_New(0);
    if (parts == NULL)
        return NULL;
    for (int t = 0; t < NTIERS; t++) {
        if (n->state[t] == ABSENT)
            continue;
        PyObject *s = PyUnicode_FromFormat(
            "%U:%ld:%U", PyTuple_GET_ITEM(TIER_NAMES, t), n->loc[t],
            PyTuple_GET_ITEM(STATE_NAMES, n->state[t]));
        if (s == NULL || PyList_Append(parts, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(parts);
            return NULL;
        }
        Py_DECREF(s);
    }
    PyObject *where;
    if (PyList_GET_SIZE(parts) == 0) {
        where = PyUnicode_FromString("nowhere");
    }
    else {
        PyObject *sep = PyUnicode_FromString("/");
        where = sep ? PyUnicode_Join(sep, parts) : NULL;
        Py_XDECREF(sep);
    }
    Py_DECREF(parts);
    if (where == NULL)
        return NULL;
    PyObject *r = PyUnicode_FromFormat("Node(%R, depth=%zd, ref=%zd, %U)", n->key,
                                       n->depth, n->ref, where);
    Py_DECREF(where);
    return r;
}

static PyMemberDef Node_members[] = {
    {"depth", T_PYSSIZET, offsetof(NodeObject, depth), 0, NULL},
    {"children", T_PYSSIZET, offsetof(NodeObject, children), 0, NULL},
    {"ref", T_PYSSIZET, offsetof(NodeObject, ref), 0, NULL},
    {"hits", T_PYSSIZET, offsetof(NodeObject, hits), 0, NULL},
    {"last_access", T_PYSSIZET, offsetof(NodeObject, last_access), 0, NULL},
    {NULL},
};

static PyGetSetDef Node_getset[] = {
    {"key", (getter)Node_get_key, NULL, NULL, NULL},
    {"parent", (getter)Node_get_parent, (setter)Node_set_parent, NULL, NULL},
    {"inflight", (getter)Node_get_inflight, (setter)Node_set_inflight, NULL, NULL},
    {"loc", (getter)Node_get_loc, (setter)Node_set_loc, NULL, NULL},
    {"state", (getter)Node_get_state, (setter)Node_set_state, NULL, NULL},
    {"matchable", (getter)Node_get_matchable, NULL, NULL, NULL},
    {NULL},
};

static PyMethodDef Node_methods[] = {
    {"best_tier", (PyCFunction)Node_best_tier, METH_NOARGS,
     "Fastest tier holding a matchable copy, or -1."},
    {NULL},
};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.Node",
    .tp_doc = "One full block of some prompt prefix (a C struct; see index_core.Node).",
    .tp_basicsize = sizeof(NodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Node_tp_new,
    .tp_dealloc = (destructor)Node_dealloc,
    .tp_traverse = (traverseproc)Node_traverse,
    .tp_clear = (inquiry)Node_clear,
    .tp_repr = (reprfunc)Node_repr,
    .tp_members = Node_members,
    .tp_getset = Node_getset,
    .tp_methods = Node_methods,
};

/* ---------------------------------------------------------------- Triple */

static void
Triple_dealloc(TripleObject *t)
{
    Py_DECREF(t->node);
    PyObject_Free(t);
}

static Py_ssize_t
Triple_len(TripleObject *t)
{
    return NTIERS;
}

static PyObject *
Triple_item(TripleObject *t, Py_ssize_t i)
{
    if (i < 0 || i >= NTIERS) {
        PyErr_SetString(PyExc_IndexError, "tier index out of range");
        return NULL;
    }
    return PyLong_FromLong(t->is_state ? t->node->state[i] : t->node->loc[i]);
}

static int
Triple_ass_item(TripleObject *t, Py_ssize_t i, PyObject *v)
{
    if (i < 0 || i >= NTIERS) {
        PyErr_SetString(PyExc_IndexError, "tier index out of range");
        return -1;
    }
    if (v == NULL) {
        PyErr_SetString(PyExc_TypeError, "a node's loc and state have no deletable items");
        return -1;
    }
    return triple_store(t->node, t->is_state, i, v);
}

static PyObject *
triple_as_list(TripleObject *t)
{
    PyObject *l = PyList_New(NTIERS);
    if (l == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < NTIERS; i++) {
        PyObject *x = Triple_item(t, i);
        if (x == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, x);
    }
    return l;
}

static PyObject *
Triple_richcompare(TripleObject *t, PyObject *other, int op)
{
    PyObject *mine = triple_as_list(t);
    if (mine == NULL)
        return NULL;
    PyObject *theirs;
    if (Py_IS_TYPE(other, &TripleType))
        theirs = triple_as_list((TripleObject *)other);
    else if (PyList_Check(other))
        theirs = Py_NewRef(other);
    else if (PyTuple_Check(other))
        theirs = PySequence_List(other);
    else {
        Py_DECREF(mine);
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (theirs == NULL) {
        Py_DECREF(mine);
        return NULL;
    }
    PyObject *r = PyObject_RichCompare(mine, theirs, op);
    Py_DECREF(mine);
    Py_DECREF(theirs);
    return r;
}

static PyObject *
Triple_repr(TripleObject *t)
{
    PyObject *l = triple_as_list(t);
    if (l == NULL)
        return NULL;
    PyObject *r = PyObject_Repr(l);
    Py_DECREF(l);
    return r;
}

static PySequenceMethods Triple_as_sequence = {
    .sq_length = (lenfunc)Triple_len,
    .sq_item = (ssizeargfunc)Triple_item,
    .sq_ass_item = (ssizeobjargproc)Triple_ass_item,
};

static PyTypeObject TripleType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.Triple",
    .tp_doc = "A node's per-tier block ids or copy states, written through to the node.",
    .tp_basicsize = sizeof(TripleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Triple_dealloc,
    .tp_as_sequence = &Triple_as_sequence,
    .tp_richcompare = (richcmpfunc)Triple_richcompare,
    .tp_repr = (reprfunc)Triple_repr,
    .tp_hash = PyObject_HashNotImplemented,
};

/* ------------------------------------------------------------- LinkedLRU */

typedef struct {
    PyObject_HEAD
    int tier;
    NodeObject *head, *tail;
    Py_ssize_t size;
} LRUObject;

static PyTypeObject LRUType;

/* Append (steals nothing: takes its own reference). */
static void
lru_append(LRUObject *o, NodeObject *n)
{
    int t = o->tier;
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->next[t] = NULL;
    n->prev[t] = o->tail;
    if (o->tail)
        o->tail->next[t] = n;
    else
        o->head = n;
    o->tail = n;
    o->size++;
}

static void
lru_prepend(LRUObject *o, NodeObject *n)
{
    int t = o->tier;
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->prev[t] = NULL;
    n->next[t] = o->head;
    if (o->head)
        o->head->prev[t] = n;
    else
        o->tail = n;
    o->head = n;
    o->size++;
}

/* Unlink; the caller inherits the list's reference. */
static void
lru_unlink(LRUObject *o, NodeObject *n)
{
    int t = o->tier;
    if (n->prev[t])
        n->prev[t]->next[t] = n->next[t];
    else
        o->head = n->next[t];
    if (n->next[t])
        n->next[t]->prev[t] = n->prev[t];
    else
        o->tail = n->prev[t];
    n->prev[t] = n->next[t] = NULL;
    n->linked &= ~(1 << t);
    o->size--;
}

#define LINKED(o, n) (((n)->linked >> (o)->tier) & 1)

static PyObject *
LRU_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", NULL};
    int tier;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:LinkedLRU", kwlist, &tier))
        return NULL;
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
    LRUObject *o = (LRUObject *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->tier = tier;
    o->head = o->tail = NULL;
    o->size = 0;
    return (PyObject *)o;
}

static int
LRU_traverse(LRUObject *o, visitproc visit, void *arg)
{
    for (NodeObject *n = o->head; n; n = n->next[o->tier])
        Py_VISIT(n);
    return 0;
}

static int
LRU_clear(LRUObject *o)
{
    while (o->head) {
        NodeObject *n = o->head;
        lru_unlink(o, n);
        Py_DECREF(n);
    }
    return 0;
}

/* A Python subclass's instances come here through subtype_dealloc, which drops
 * their reference to the subclass itself. */
static void
LRU_dealloc(LRUObject *o)
{
    PyObject_GC_UnTrack(o);
    LRU_clear(o);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *
LRU_insert(LRUObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (n->ref == 0 && !LINKED(o, n))
        lru_append(o, n);
    Py_RETURN_NONE;
}

static PyObject *
LRU_remove(LRUObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (LINKED(o, n)) {
        lru_unlink(o, n);
        Py_DECREF(n);
    }
    Py_RETURN_NONE;
}

static int
lru_ref(LRUObject *o, NodeObject *n)
{
    if (!LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, (PyObject *)n);
        return -1;
    }
    lru_unlink(o, n);
    Py_DECREF(n);
    return 0;
}

static PyObject *
LRU_ref(LRUObject *o, PyObject *arg)
{
    if (node_check(arg) < 0 || lru_ref(o, (NodeObject *)arg) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
LRU_unref(LRUObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    if (!LINKED(o, (NodeObject *)arg))
        lru_append(o, (NodeObject *)arg);
    Py_RETURN_NONE;
}

static PyObject *
LRU_unref_all(LRUObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "unref_all takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++)
        if (!LINKED(o, (NodeObject *)items[i]))
            lru_append(o, (NodeObject *)items[i]);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
LRU_first(LRUObject *o, PyObject *unused)
{
    return Py_NewRef(o->head ? (PyObject *)o->head : Py_None);
}

static PyObject *
LRU_pop_front(LRUObject *o, PyObject *arg)
{
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (k > o->size)
        k = o->size;
    if (k < 0)
        k = 0;
    PyObject *out = PyList_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        NodeObject *n = o->head;
        lru_unlink(o, n);
        PyList_SET_ITEM(out, i, (PyObject *)n);  /* the list's reference moves over */
    }
    return out;
}

static PyObject *
LRU_push_front(LRUObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "push_front takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = len - 1; i >= 0; i--) {
        NodeObject *n = (NodeObject *)items[i];
        if (LINKED(o, n)) {  /* as OrderedDict.move_to_end(last=False) */
            lru_unlink(o, n);
            Py_DECREF(n);
        }
        lru_prepend(o, n);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
LRU_move_to_end(LRUObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    lru_unlink(o, n);
    lru_append(o, n);
    Py_DECREF(n);
    Py_RETURN_NONE;
}

static PyObject *
LRU_holds(LRUObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    return PyBool_FromLong(LINKED(o, (NodeObject *)arg));
}

static PyObject *
lru_as_list(LRUObject *o)
{
    PyObject *out = PyList_New(o->size);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (NodeObject *n = o->head; n; n = n->next[o->tier])
        PyList_SET_ITEM(out, i++, Py_NewRef(n));
    return out;
}

static PyObject *
LRU_tracked(LRUObject *o, PyObject *unused)
{
    PyObject *l = lru_as_list(o);
    if (l == NULL)
        return NULL;
    PyObject *s = PySet_New(l);
    Py_DECREF(l);
    return s;
}

static PyObject *
LRU_iter(LRUObject *o)
{
    PyObject *l = lru_as_list(o);
    if (l == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(l);
    Py_DECREF(l);
    return it;
}

static Py_ssize_t
LRU_len(LRUObject *o)
{
    return o->size;
}

static PyObject *
LRU_get_tier(LRUObject *o, void *c)
{
    return PyLong_FromLong(o->tier);
}

static PyMethodDef LRU_methods[] = {
    {"insert", (PyCFunction)LRU_insert, METH_O, "Order a ready copy (if unreferenced)."},
    {"remove", (PyCFunction)LRU_remove, METH_O, "Forget a copy (if ordered)."},
    {"ref", (PyCFunction)LRU_ref, METH_O, "The node's reference count left 0: unorder it."},
    {"unref", (PyCFunction)LRU_unref, METH_O, "The node's reference count reached 0."},
    {"unref_all", (PyCFunction)LRU_unref_all, METH_O, "unref each, in order."},
    {"first", (PyCFunction)LRU_first, METH_NOARGS, "The first candidate, in O(1)."},
    {"pop_front", (PyCFunction)LRU_pop_front, METH_O, "Remove and return the first k."},
    {"push_front", (PyCFunction)LRU_push_front, METH_O, "Undo pop_front for these nodes."},
    {"move_to_end", (PyCFunction)LRU_move_to_end, METH_O, "Move an ordered node last."},
    {"holds", (PyCFunction)LRU_holds, METH_O, "Whether the node is ordered here."},
    {"tracked", (PyCFunction)LRU_tracked, METH_NOARGS, "The ordered nodes, as a set."},
    {NULL},
};

static PyGetSetDef LRU_getset[] = {
    {"tier", (getter)LRU_get_tier, NULL, NULL, NULL},
    {NULL},
};

static PySequenceMethods LRU_as_sequence = {
    .sq_length = (lenfunc)LRU_len,
};

static PyTypeObject LRUType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.LinkedLRU",
    .tp_doc = "LRU order of one tier's unreferenced copies, linked through the nodes.",
    .tp_basicsize = sizeof(LRUObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = LRU_tp_new,
    .tp_dealloc = (destructor)LRU_dealloc,
    .tp_traverse = (traverseproc)LRU_traverse,
    .tp_clear = (inquiry)LRU_clear,
    .tp_iter = (getiterfunc)LRU_iter,
    .tp_as_sequence = &LRU_as_sequence,
    .tp_methods = LRU_methods,
    .tp_getset = LRU_getset,
};

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
    long long rank;
    NodeObject *head, *tail;
    Py_ssize_t size;
} Bucket;

typedef struct {
    PyObject_HEAD
    int tier, kind;
    Bucket *b;            /* sorted by rank; none empty */
    Py_ssize_t nb, cap;
    Py_ssize_t size;
} BucketsObject;

static PyTypeObject BucketsType;

#define BK_LINKED(o, n) (((n)->linked >> (o)->tier) & 1)

static long long
bk_rank(BucketsObject *o, NodeObject *n)
{
    if (o->kind == BUCKETS_LFU)
        return (long long)n->hits;
    return ((long long)n->hits << DEPTH_BITS) - (long long)n->depth;
}

/* Index of the first bucket whose rank is >= ``rank``. */
static Py_ssize_t
bk_find(BucketsObject *o, long long rank)
{
    Py_ssize_t lo = 0, hi = o->nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (o->b[mid].rank < rank)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The bucket of ``rank``, made (empty) if missing; -1 on no memory. */
static Py_ssize_t
bk_bucket(BucketsObject *o, long long rank)
{
    Py_ssize_t i = bk_find(o, rank);
    if (i < o->nb && o->b[i].rank == rank)
        return i;
    if (o->nb == o->cap) {
        Py_ssize_t cap = o->cap ? 2 * o->cap : 16;
        Bucket *b = PyMem_Realloc(o->b, cap * sizeof(Bucket));
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->b = b;
        o->cap = cap;
    }
    memmove(o->b + i + 1, o->b + i, (o->nb - i) * sizeof(Bucket));
    o->b[i].rank = rank;
    o->b[i].head = o->b[i].tail = NULL;
    o->b[i].size = 0;
    o->nb++;
    return i;
}

/* Link ``n`` at the end (or front) of its bucket; takes its own reference. */
static int
bk_link(BucketsObject *o, NodeObject *n, int front)
{
    int t = o->tier;
    long long rank = bk_rank(o, n);
    Py_ssize_t i = bk_bucket(o, rank);
    if (i < 0)
        return -1;
    Bucket *b = &o->b[i];
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->rank[t] = rank;
    if (front) {
        n->prev[t] = NULL;
        n->next[t] = b->head;
        if (b->head)
            b->head->prev[t] = n;
        else
            b->tail = n;
        b->head = n;
    } else {
        n->next[t] = NULL;
        n->prev[t] = b->tail;
        if (b->tail)
            b->tail->next[t] = n;
        else
            b->head = n;
        b->tail = n;
    }
    b->size++;
    o->size++;
    return 0;
}

/* Unlink a linked node; the caller inherits the order's reference. */
static void
bk_unlink(BucketsObject *o, NodeObject *n)
{
    int t = o->tier;
    Py_ssize_t i = bk_find(o, n->rank[t]);
    Bucket *b = &o->b[i];  /* (a linked node's bucket exists) */
    if (n->prev[t])
        n->prev[t]->next[t] = n->next[t];
    else
        b->head = n->next[t];
    if (n->next[t])
        n->next[t]->prev[t] = n->prev[t];
    else
        b->tail = n->prev[t];
    n->prev[t] = n->next[t] = NULL;
    n->linked &= ~(1 << t);
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
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
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
    if (n->ref == 0 && !BK_LINKED(o, n) && bk_link(o, n, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Buckets_remove(BucketsObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (BK_LINKED(o, n)) {
        bk_unlink(o, n);
        Py_DECREF(n);
    }
    Py_RETURN_NONE;
}

static PyObject *
Buckets_ref(BucketsObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!BK_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
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
    if (!BK_LINKED(o, n) && bk_link(o, n, 0) < 0)
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
        if (!BK_LINKED(o, n) && bk_link(o, n, 0) < 0) {
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
        if (BK_LINKED(o, n)) {
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
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!BK_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
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
    return PyBool_FromLong(BK_LINKED(o, (NodeObject *)arg));
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

/* ------------------------------------------------------------- LinkedARC */

/* kvflow.arc.ARC with its two lists linked through the nodes (the same per-tier
 * links as LinkedLRU: one policy per tier). Everything else is ARC's exactly: the
 * ghost lists B1, B2 are ``Ghosts`` (an OrderedDict's semantics; touched once per
 * victim and per ghost hit), ``p`` a double updated by the same expressions. A node's
 * ``rank[t]`` says where it is: 1 or 2 while linked in T1 or T2; while
 * referenced (unlinked), 1 or 2 if it was in T1 or T2 when its reference came
 * (Python's ``_held``), else 0. ``candidates`` stays in Python (kvflow.arc), on
 * the primitives here. */

typedef struct {
    NodeObject *head, *tail;
    Py_ssize_t size;
} ArcList;

typedef struct {
    PyObject_HEAD
    int tier;
    Py_ssize_t capacity;
    double p;
    ArcList l[3];           /* l[1]: T1, l[2]: T2 */
    Ghosts b[3];            /* b[1], b[2]: B1 and B2 */
    char *popped;           /* where the last pop_front's victims were, in order */
    Py_ssize_t npopped, popcap;
} ARCObject;

static PyTypeObject ARCType;
static PyObject *s_popitem;

#define ARC_LINKED(o, n) (((n)->linked >> (o)->tier) & 1)

static void
arc_append(ARCObject *o, NodeObject *n, int w)
{
    int t = o->tier;
    ArcList *l = &o->l[w];
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->rank[t] = w;
    n->next[t] = NULL;
    n->prev[t] = l->tail;
    if (l->tail)
        l->tail->next[t] = n;
    else
        l->head = n;
    l->tail = n;
    l->size++;
}

static void
arc_prepend(ARCObject *o, NodeObject *n, int w)
{
    int t = o->tier;
    ArcList *l = &o->l[w];
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->rank[t] = w;
    n->prev[t] = NULL;
    n->next[t] = l->head;
    if (l->head)
        l->head->prev[t] = n;
    else
        l->tail = n;
    l->head = n;
    l->size++;
}

/* Unlink a linked node (rank[t] is left as the list it was in); the caller
 * inherits the list's reference. */
static void
arc_unlink(ARCObject *o, NodeObject *n)
{
    int t = o->tier;
    ArcList *l = &o->l[n->rank[t]];
    if (n->prev[t])
        n->prev[t]->next[t] = n->next[t];
    else
        l->head = n->next[t];
    if (n->next[t])
        n->next[t]->prev[t] = n->prev[t];
    else
        l->tail = n->prev[t];
    n->prev[t] = n->next[t] = NULL;
    n->linked &= ~(1 << t);
    l->size--;
}

static PyObject *
ARC_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "capacity", NULL};
    int tier;
    Py_ssize_t capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|n:LinkedARC", kwlist, &tier, &capacity))
        return NULL;
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
    ARCObject *o = (ARCObject *)type->tp_alloc(type, 0);
    if (o == NULL)
        return NULL;
    o->tier = tier;
    o->capacity = capacity < 1 ? 1 : capacity;
    o->p = 0.0;
    if (ghosts_init(&o->b[1]) < 0 || ghosts_init(&o->b[2]) < 0) {
        Py_DECREF(o);
        return NULL;
    }
    return (PyObject *)o;
}

static int
ARC_traverse(ARCObject *o, visitproc visit, void *arg)
{
    for (int w = 1; w <= 2; w++) {
        for (NodeObject *n = o->l[w].head; n; n = n->next[o->tier])
            Py_VISIT(n);
        if (ghosts_traverse(&o->b[w], visit, arg))
            return -1;
    }
    return 0;
}

static int
ARC_clear(ARCObject *o)
{
    for (int w = 1; w <= 2; w++) {
        while (o->l[w].head) {
            NodeObject *n = o->l[w].head;
            arc_unlink(o, n);
            n->rank[o->tier] = 0;
            Py_DECREF(n);
        }
        ghosts_clear(&o->b[w]);
    }
    return 0;
}

static void
ARC_dealloc(ARCObject *o)
{
    PyObject_GC_UnTrack(o);
    ARC_clear(o);
    PyMem_Free(o->popped);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

/* A node's last reference went (or its copy became ready unreferenced). */
static int
arc_unref_one(ARCObject *o, NodeObject *n)
{
    int t = o->tier;
    if (ARC_LINKED(o, n))  /* ordered already: as ``od[node] = None``, it stays put */
        return 0;
    if (n->rank[t]) {  /* held: used again, frequent */
        arc_append(o, n, 2);
        return 0;
    }
    Ghosts *b1 = &o->b[1], *b2 = &o->b[2];
    int in1 = PyDict_Contains(b1->map, n->key);
    if (in1 < 0)
        return -1;
    if (in1) {  /* a ghost hit: T1 was too small */
        double l1 = (double)GHOSTS_LEN(b1), l2 = (double)GHOSTS_LEN(b2);
        double d = l2 / l1, np = o->p + (d > 1.0 ? d : 1.0);
        o->p = (double)o->capacity < np ? (double)o->capacity : np;
        if (PyDict_DelItem(b1->map, n->key) < 0)
            return -1;
        arc_append(o, n, 2);
        return 0;
    }
    int in2 = PyDict_Contains(b2->map, n->key);
    if (in2 < 0)
        return -1;
    if (in2) {  /* T2 was */
        double l1 = (double)GHOSTS_LEN(b1), l2 = (double)GHOSTS_LEN(b2);
        double d = l1 / l2, np = o->p - (d > 1.0 ? d : 1.0);
        o->p = np > 0.0 ? np : 0.0;
        if (PyDict_DelItem(b2->map, n->key) < 0)
            return -1;
        arc_append(o, n, 2);
        return 0;
    }
    arc_append(o, n, 1);
    return 0;
}

static PyObject *
ARC_insert(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    if (((NodeObject *)arg)->ref == 0 && arc_unref_one(o, (NodeObject *)arg) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
ARC_unref(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0 || arc_unref_one(o, (NodeObject *)arg) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
ARC_unref_all(ARCObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "unref_all takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++)
        if (arc_unref_one(o, (NodeObject *)items[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
ARC_ref(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!ARC_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    arc_unlink(o, n);  /* rank[t] keeps 1 or 2: held */
    Py_DECREF(n);
    Py_RETURN_NONE;
}

/* Ghosts are kept to the capacity in all, B1 trimmed first while T1 and B1
 * together exceed it (ARC's |T1| + |B1| <= c). */
static int
arc_trim_ghosts(ARCObject *o)
{
    Py_ssize_t l1 = GHOSTS_LEN(&o->b[1]), l2 = GHOSTS_LEN(&o->b[2]);
    Py_ssize_t over = l1 + l2 - o->capacity;
    if (over <= 0)
        return 0;
    Py_ssize_t x = o->l[1].size + l1 - o->capacity;
    if (x < 0)
        x = 0;
    Py_ssize_t from_b1 = over < l1 ? over : l1;
    if (x < from_b1)
        from_b1 = x;
    if (l2 < over - from_b1)
        from_b1 = over - l2;
    for (int w = 1; w <= 2; w++) {
        Py_ssize_t k = w == 1 ? from_b1 : over - from_b1;
        for (Py_ssize_t i = 0; i < k; i++)
            if (ghosts_pop_oldest(&o->b[w]) < 0)
                return -1;
    }
    return 0;
}

static PyObject *
ARC_remove(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    int t = o->tier;
    int w = (int)n->rank[t];
    if (ARC_LINKED(o, n)) {
        arc_unlink(o, n);
        Py_DECREF(n);
    }
    else if (!w) {
        Py_RETURN_NONE;
    }
    n->rank[t] = 0;
    if (ghosts_add(&o->b[w], n->key) < 0 || arc_trim_ghosts(o) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ARC's REPLACE: T1's LRU end while T1 is over its target, else T2's; 0: none. */
static int
arc_victim_list(ARCObject *o)
{
    Py_ssize_t l1 = o->l[1].size, l2 = o->l[2].size;
    if (l1 && ((double)l1 > o->p || !l2))
        return 1;
    return l2 ? 2 : 0;
}

static PyObject *
ARC_first(ARCObject *o, PyObject *unused)
{
    int w = arc_victim_list(o);
    return Py_NewRef(w ? (PyObject *)o->l[w].head : Py_None);
}

static PyObject *
ARC_pop_front(ARCObject *o, PyObject *arg)
{
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    o->npopped = 0;
    while (PyList_GET_SIZE(out) < k) {
        int w = arc_victim_list(o);
        if (!w)
            break;
        Py_ssize_t run = k - PyList_GET_SIZE(out);
        if (w == 1 && o->l[2].size) {  /* as long as REPLACE would keep choosing T1 */
            double c = ceil((double)o->l[1].size - o->p);
            Py_ssize_t m = c < 1.0 ? 1 : (Py_ssize_t)c;
            if (m < run)
                run = m;
        }
        if (o->npopped + run > o->popcap) {
            Py_ssize_t cap = o->popcap ? o->popcap : 64;
            while (cap < o->npopped + run)
                cap *= 2;
            char *pp = PyMem_Realloc(o->popped, cap);
            if (pp == NULL) {
                Py_DECREF(out);
                return PyErr_NoMemory();
            }
            o->popped = pp;
            o->popcap = cap;
        }
        for (Py_ssize_t i = 0; i < run && o->l[w].head; i++) {
            NodeObject *n = o->l[w].head;
            arc_unlink(o, n);
            n->rank[o->tier] = 0;
            if (PyList_Append(out, (PyObject *)n) < 0 ||
                ghosts_add(&o->b[w], n->key) < 0) {
                Py_DECREF(n);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(n);  /* the list holds it */
            o->popped[o->npopped++] = (char)w;
        }
    }
    if (arc_trim_ghosts(o) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *
ARC_push_front(ARCObject *o, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "push_front takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (len > o->npopped) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "push_front: more nodes than the last pop_front's");
        return NULL;
    }
    Py_ssize_t base = o->npopped - len;
    for (Py_ssize_t i = len - 1; i >= 0; i--) {
        NodeObject *n = (NodeObject *)items[i];
        int w = o->popped[base + i];
        if (ARC_LINKED(o, n)) {
            arc_unlink(o, n);
            Py_DECREF(n);
        }
        arc_prepend(o, n, w);
        if (ghosts_discard(&o->b[w], n->key) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
ARC_move_to_end(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!ARC_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    int w = (int)n->rank[o->tier];
    arc_unlink(o, n);
    arc_append(o, n, w);
    Py_DECREF(n);
    Py_RETURN_NONE;
}

/* Where the node is: 1 (T1), 2 (T2), else 0; ``held``: where a referenced one was. */
static PyObject *
ARC_where(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    return PyLong_FromLong(ARC_LINKED(o, n) ? (long)n->rank[o->tier] : 0);
}

static PyObject *
ARC_held(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    return PyLong_FromLong(ARC_LINKED(o, n) ? 0 : (long)n->rank[o->tier]);
}

static PyObject *
ARC_victim_list(ARCObject *o, PyObject *unused)
{
    return PyLong_FromLong(arc_victim_list(o));
}

static PyObject *
arc_as_list(ARCObject *o, int w)
{
    PyObject *out = PyList_New(o->l[w].size);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (NodeObject *n = o->l[w].head; n; n = n->next[o->tier])
        PyList_SET_ITEM(out, i++, Py_NewRef(n));
    return out;
}

static PyObject *
ARC_list(ARCObject *o, PyObject *arg)
{
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    if (w != 1 && w != 2) {
        PyErr_SetString(PyExc_ValueError, "ARC lists are 1 (T1) and 2 (T2)");
        return NULL;
    }
    return arc_as_list(o, (int)w);
}

static PyObject *
ARC_head(ARCObject *o, PyObject *arg)
{
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    if (w != 1 && w != 2) {
        PyErr_SetString(PyExc_ValueError, "ARC lists are 1 (T1) and 2 (T2)");
        return NULL;
    }
    return Py_NewRef(o->l[w].head ? (PyObject *)o->l[w].head : Py_None);
}

static PyObject *
ARC_tracked(ARCObject *o, PyObject *unused)
{
    PyObject *s = PySet_New(NULL);
    for (int w = 1; s && w <= 2; w++)
        for (NodeObject *n = o->l[w].head; n; n = n->next[o->tier])
            if (PySet_Add(s, (PyObject *)n) < 0) {
                Py_CLEAR(s);
                break;
            }
    return s;
}

static Py_ssize_t
ARC_len(ARCObject *o)
{
    return o->l[1].size + o->l[2].size;
}

static PyObject *
ARC_get(ARCObject *o, void *which)
{
    switch ((int)(intptr_t)which) {
    case 0: return PyLong_FromLong(o->tier);
    case 1: return PyLong_FromSsize_t(o->capacity);
    case 2: return PyFloat_FromDouble(o->p);
    case 3: return ghosts_snapshot(&o->b[1]);
    default: return ghosts_snapshot(&o->b[2]);
    }
}

static PyMethodDef ARC_methods[] = {
    {"insert", (PyCFunction)ARC_insert, METH_O, "Order a ready copy (if unreferenced)."},
    {"remove", (PyCFunction)ARC_remove, METH_O, "Forget a copy: its key becomes a ghost."},
    {"ref", (PyCFunction)ARC_ref, METH_O, "The node's reference count left 0: unorder it."},
    {"unref", (PyCFunction)ARC_unref, METH_O, "The node's reference count reached 0."},
    {"unref_all", (PyCFunction)ARC_unref_all, METH_O, "unref each, in order."},
    {"first", (PyCFunction)ARC_first, METH_NOARGS, "REPLACE's victim, in O(1)."},
    {"pop_front", (PyCFunction)ARC_pop_front, METH_O, "Remove and return up to k victims."},
    {"push_front", (PyCFunction)ARC_push_front, METH_O, "Undo pop_front for these nodes."},
    {"move_to_end", (PyCFunction)ARC_move_to_end, METH_O, "Move a node last in its list."},
    {"where", (PyCFunction)ARC_where, METH_O, "1 (in T1), 2 (in T2) or 0."},
    {"held", (PyCFunction)ARC_held, METH_O, "Where a referenced node was: 1, 2 or 0."},
    {"victim_list", (PyCFunction)ARC_victim_list, METH_NOARGS, "REPLACE's list: 1, 2, 0."},
    {"list", (PyCFunction)ARC_list, METH_O, "T1 (1) or T2 (2), LRU end first."},
    {"head", (PyCFunction)ARC_head, METH_O, "The LRU end of T1 (1) or T2 (2), or None."},
    {"tracked", (PyCFunction)ARC_tracked, METH_NOARGS, "The ordered nodes, as a set."},
    {NULL},
};

static PyGetSetDef ARC_getset[] = {
    {"tier", (getter)ARC_get, NULL, NULL, (void *)0},
    {"capacity", (getter)ARC_get, NULL, NULL, (void *)1},
    {"p", (getter)ARC_get, NULL, NULL, (void *)2},
    {"_b1", (getter)ARC_get, NULL, NULL, (void *)3},
    {"_b2", (getter)ARC_get, NULL, NULL, (void *)4},
    {NULL},
};

static PySequenceMethods ARC_as_sequence = {
    .sq_length = (lenfunc)ARC_len,
};

static PyTypeObject ARCType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.LinkedARC",
    .tp_doc = "ARC over one tier's unreferenced copies, its lists linked through the nodes.",
    .tp_basicsize = sizeof(ARCObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = ARC_tp_new,
    .tp_dealloc = (destructor)ARC_dealloc,
    .tp_traverse = (traverseproc)ARC_traverse,
    .tp_clear = (inquiry)ARC_clear,
    .tp_as_sequence = &ARC_as_sequence,
    .tp_methods = ARC_methods,
    .tp_getset = ARC_getset,
};

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
    ArcList q[3];           /* q[1]: small, q[2]: main */
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

#define S3_LINKED(o, n) (((n)->linked >> (o)->tier) & 1)
#define S3_Q(o, n) ((int)((n)->rank[(o)->tier] >> 8))
#define S3_F(o, n) ((int)((n)->rank[(o)->tier] & 0xff))

static void
s3_append(S3Object *o, NodeObject *n, int q, int freq)
{
    int t = o->tier;
    ArcList *l = &o->q[q];
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->rank[t] = ((long long)q << 8) | freq;
    n->next[t] = NULL;
    n->prev[t] = l->tail;
    if (l->tail)
        l->tail->next[t] = n;
    else
        l->head = n;
    l->tail = n;
    l->size++;
}

/* Unlink a linked node; the caller inherits the queue's reference. */
static void
s3_unlink(S3Object *o, NodeObject *n)
{
    int t = o->tier;
    ArcList *l = &o->q[S3_Q(o, n)];
    if (n->prev[t])
        n->prev[t]->next[t] = n->next[t];
    else
        l->head = n->next[t];
    if (n->next[t])
        n->next[t]->prev[t] = n->prev[t];
    else
        l->tail = n->prev[t];
    n->prev[t] = n->next[t] = NULL;
    n->linked &= ~(1 << t);
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
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
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
    if (S3_LINKED(o, n)) {  /* queued already: it keeps its place, its frequency resets */
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
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!S3_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
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
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!S3_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
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
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!S3_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    return PyLong_FromLong(S3_F(o, n));
}

static PyObject *
S3_holds(S3Object *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    return PyBool_FromLong(S3_LINKED(o, (NodeObject *)arg));
}

static PyObject *
S3_tracked(S3Object *o, PyObject *unused)
{
    PyObject *s = PySet_New(NULL);
    for (int q = 1; s && q <= 2; q++)
        for (NodeObject *n = o->q[q].head; n; n = n->next[o->tier])
            if (PySet_Add(s, (PyObject *)n) < 0) {
                Py_CLEAR(s);
                break;
            }
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
            if (S3_LINKED(o, n)) {  /* declined: behind the rest of its queue */
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

#define CO_LINKED(o, n) (((n)->linked >> (o)->tier) & 1)
#define CO_RANK(o, n) ((n)->rank[(o)->tier] >> 2)
#define CO_TAG(o, n) ((int)((n)->rank[(o)->tier] & 3) - 1)

static Py_ssize_t
co_find(CostObject *o, long long rank)
{
    Py_ssize_t lo = 0, hi = o->nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (o->b[mid].rank < rank)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int
co_link(CostObject *o, NodeObject *n, long long rank, int tag, int front)
{
    int t = o->tier;
    Py_ssize_t i = co_find(o, rank);
    if (!(i < o->nb && o->b[i].rank == rank)) {
        if (o->nb == o->cap) {
            Py_ssize_t cap = o->cap ? 2 * o->cap : 16;
            Bucket *b = PyMem_Realloc(o->b, cap * sizeof(Bucket));
            if (b == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            o->b = b;
            o->cap = cap;
        }
        memmove(o->b + i + 1, o->b + i, (o->nb - i) * sizeof(Bucket));
        o->b[i].rank = rank;
        o->b[i].head = o->b[i].tail = NULL;
        o->b[i].size = 0;
        o->nb++;
    }
    Bucket *b = &o->b[i];
    Py_INCREF(n);
    n->linked |= 1 << t;
    n->rank[t] = (rank << 2) | (long long)(tag + 1);
    if (front) {
        n->prev[t] = NULL;
        n->next[t] = b->head;
        if (b->head)
            b->head->prev[t] = n;
        else
            b->tail = n;
        b->head = n;
    }
    else {
        n->next[t] = NULL;
        n->prev[t] = b->tail;
        if (b->tail)
            b->tail->next[t] = n;
        else
            b->head = n;
        b->tail = n;
    }
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
    Py_ssize_t i = co_find(o, CO_RANK(o, n));
    Bucket *b = &o->b[i];
    if (n->prev[t])
        n->prev[t]->next[t] = n->next[t];
    else
        b->head = n->next[t];
    if (n->next[t])
        n->next[t]->prev[t] = n->prev[t];
    else
        b->tail = n->prev[t];
    n->prev[t] = n->next[t] = NULL;
    n->linked &= ~(1 << t);
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
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
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
    if (CO_LINKED(o, n)) {
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
    if (above != NULL && CO_LINKED(above, n)) {  /* a cheaper route back: worth less there */
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
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!CO_LINKED(o, n)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    co_unlink(o, n);
    Py_DECREF(n);
    Py_RETURN_NONE;
}

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
            Py_ssize_t i = co_find(o, r);
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
        if (CO_LINKED(o, n)) {
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

static PyObject *
Cost_tracked(CostObject *o, PyObject *unused)
{
    PyObject *s = PySet_New(NULL);
    for (Py_ssize_t i = 0; s && i < o->nb; i++)
        for (NodeObject *n = o->b[i].head; n; n = n->next[o->tier])
            if (PySet_Add(s, (PyObject *)n) < 0) {
                Py_CLEAR(s);
                break;
            }
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
    Py_ssize_t i = co_find(o, rank);
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
        if (CO_LINKED(o, n) && CO_RANK(o, n) == r) {
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

/* ------------------------------------------------------------------ Core */

typedef struct {
    PyObject_HEAD
    PyObject *nodes;        /* dict key -> Node */
    /* Each tier's policy, taken at construction (an index's policies are fixed). */
    PyObject *policy[NTIERS];
    LRUObject *lru[NTIERS]; /* policy[t] where it is a LinkedLRU, else NULL */
    PyObject *unreferenced; /* list of 3 ints */
    int orders_referenced[NTIERS];
    int active[NTIERS];     /* tiers with capacity */
} CoreObject;

static PyObject *
Core_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nodes", "policies", "unreferenced", "tiers", NULL};
    PyObject *nodes, *policies, *unref, *tiers;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O:Core", kwlist, &PyDict_Type, &nodes,
                                     &PyList_Type, &policies, &PyList_Type, &unref, &tiers))
        return NULL;
    if (PyList_GET_SIZE(policies) != NTIERS || PyList_GET_SIZE(unref) != NTIERS) {
        PyErr_SetString(PyExc_ValueError, "Core needs 3 policies and 3 unreferenced counts");
        return NULL;
    }
    CoreObject *c = (CoreObject *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->nodes = Py_NewRef(nodes);
    c->unreferenced = Py_NewRef(unref);
    for (int t = 0; t < NTIERS; t++) {
        PyObject *p = c->policy[t] = Py_NewRef(PyList_GET_ITEM(policies, t));
        c->lru[t] = PyObject_TypeCheck(p, &LRUType) ? (LRUObject *)p : NULL;
        if (c->lru[t] && c->lru[t]->tier != t) {
            PyErr_Format(PyExc_ValueError, "the LinkedLRU of tier %d links tier %d", t,
                         c->lru[t]->tier);
            Py_DECREF(c);
            return NULL;
        }
        PyObject *o = PyObject_GetAttr(p, s_orders_referenced);
        int r = o ? PyObject_IsTrue(o) : -1;
        Py_XDECREF(o);
        if (r < 0) {
            Py_DECREF(c);
            return NULL;
        }
        c->orders_referenced[t] = r;
        c->active[t] = 0;
    }
    PyObject *seq = PySequence_Fast(tiers, "tiers must be a sequence of tier numbers");
    if (seq == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long t = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (t < 0 || t >= NTIERS) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %ld", t);
            Py_DECREF(seq);
            Py_DECREF(c);
            return NULL;
        }
        c->active[t] = 1;
    }
    Py_DECREF(seq);
    return (PyObject *)c;
}

static int
Core_traverse(CoreObject *c, visitproc visit, void *arg)
{
    Py_VISIT(c->nodes);
    Py_VISIT(c->unreferenced);
    for (int t = 0; t < NTIERS; t++)
        Py_VISIT(c->policy[t]);
    return 0;
}

static int
Core_clear(CoreObject *c)
{
    for (int t = 0; t < NTIERS; t++) {
        c->lru[t] = NULL;
        Py_CLEAR(c->policy[t]);
    }
    Py_CLEAR(c->nodes);
    Py_CLEAR(c->unreferenced);
    return 0;
}

static void
Core_dealloc(CoreObject *c)
{
    PyObject_GC_UnTrack(c);
    Core_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* unreferenced[t] += delta */
static int
core_add_unreferenced(CoreObject *c, int t, Py_ssize_t delta)
{
    if (delta == 0)
        return 0;
    if (PyList_GET_SIZE(c->unreferenced) != NTIERS) {
        PyErr_SetString(PyExc_RuntimeError, "the index's unreferenced counts must stay 3");
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(c->unreferenced, t);
    Py_ssize_t v = PyLong_AsSsize_t(old);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromSsize_t(v + delta);
    if (nv == NULL)
        return -1;
    PyList_SetItem(c->unreferenced, t, nv);  /* steals nv, drops old */
    return 0;
}

static PyObject *
Core_match(CoreObject *c, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "match takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *n = PyDict_GetItemWithError(c->nodes, items[i]);
        if (n == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (node_check(n) < 0)
            goto fail;
        if (((NodeObject *)n)->state[0] == COMPUTING)
            break;
        if (PyList_Append(out, n) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* Take one reference; its READY copies leave the orders that skip referenced nodes. */
static int
core_ref_one(CoreObject *c, NodeObject *n, Py_ssize_t *delta)
{
    if (n->ref == 0) {
        for (int t = 0; t < NTIERS; t++) {
            if (n->state[t] != READY)
                continue;
            delta[t]--;
            if (c->lru[t]) {
                if (lru_ref(c->lru[t], n) < 0)
                    return -1;
            }
            else {
                PyObject *r = PyObject_CallMethodOneArg(c->policy[t], s_ref,
                                                        (PyObject *)n);
                if (r == NULL)
                    return -1;
                Py_DECREF(r);
            }
        }
    }
    n->ref++;
    return 0;
}

static int
core_apply(CoreObject *c, Py_ssize_t *delta)
{
    for (int t = 0; t < NTIERS; t++)
        if (core_add_unreferenced(c, t, delta[t]) < 0)
            return -1;
    return 0;
}

static PyObject *
Core_ref_all(CoreObject *c, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "ref_all takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t delta[NTIERS] = {0, 0, 0};
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int err = 0;
    for (Py_ssize_t i = 0; i < len && !err; i++)
        err = core_ref_one(c, (NodeObject *)items[i], delta);
    Py_DECREF(seq);
    if (err) {  /* keep the counts true to what was done */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        core_apply(c, delta);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    if (core_apply(c, delta) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Core_best_tiers(CoreObject *c, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "best_tiers takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(len);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *v = PyLong_FromLong(node_best_tier((NodeObject *)items[i]));
        if (v == NULL) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *
Core_computing_on_device(CoreObject *c, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "computing_on_device takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < len; i++)
        if (((NodeObject *)items[i])->state[0] == COMPUTING && PyList_Append(out, items[i]) < 0)
            Py_CLEAR(out);
    Py_DECREF(seq);
    return out;
}

static PyObject *
Core_add_computing(CoreObject *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"parent", "keys", "device_ids", "now", NULL};
    PyObject *parent, *keys, *ids;
    Py_ssize_t now;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOn:add_computing", kwlist, &parent, &keys,
                                     &ids, &now))
        return NULL;
    if (parent != Py_None && node_check(parent) < 0)
        return NULL;
    PyObject *kseq = PySequence_Fast(keys, "add_computing takes a sequence of keys");
    if (kseq == NULL)
        return NULL;
    PyObject *iseq = PySequence_Fast(ids, "add_computing takes a sequence of block ids");
    if (iseq == NULL) {
        Py_DECREF(kseq);
        return NULL;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(kseq);
    PyObject *out = NULL;
    if (PySequence_Fast_GET_SIZE(iseq) != len) {
        PyErr_Format(PyExc_ValueError, "add_computing: %zd keys but %zd block ids", len,
                     PySequence_Fast_GET_SIZE(iseq));
        goto done;
    }
    PyObject **kitems = PySequence_Fast_ITEMS(kseq);
    PyObject **iitems = PySequence_Fast_ITEMS(iseq);
    /* All ids first: a bad one must not leave half a chain indexed. */
    long stack_ids[64];
    long *dev = len <= 64 ? stack_ids : PyMem_Malloc(len * sizeof(long));
    if (dev == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        dev[i] = PyLong_AsLong(iitems[i]);
        if (dev[i] == -1 && PyErr_Occurred())
            goto free_ids;
    }
    out = PyList_New(0);
    if (out == NULL)
        goto free_ids;
    NodeObject *up = parent == Py_None ? NULL : (NodeObject *)parent;
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = node_new_raw(kitems[i], up);
        if (n == NULL)
            goto fail;
        n->loc[0] = dev[i];
        n->state[0] = COMPUTING;
        n->ref = 1;
        n->last_access = now;
        PyObject *had = PyDict_SetDefault(c->nodes, kitems[i], (PyObject *)n);
        if (had != (PyObject *)n) {  /* indexed already (or an error): stop here */
            Py_DECREF(n);
            if (had == NULL)
                goto fail;
            break;
        }
        if (PyList_Append(out, (PyObject *)n) < 0) {
            PyDict_DelItem(c->nodes, kitems[i]);
            Py_DECREF(n);
            goto fail;
        }
        Py_DECREF(n);  /* the dict and the list hold it */
        if (up)
            up->children++;
        up = n;
    }
    goto free_ids;
fail:
    /* Undo the chain made so far, tail first, so the index is as it was. */
    if (out) {
        for (Py_ssize_t i = PyList_GET_SIZE(out) - 1; i >= 0; i--) {
            NodeObject *n = (NodeObject *)PyList_GET_ITEM(out, i);
            if (n->parent)
                n->parent->children--;
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyDict_DelItem(c->nodes, n->key);
            PyErr_Restore(et, ev, tb);
        }
        Py_CLEAR(out);
    }
free_ids:
    if (dev != stack_ids)
        PyMem_Free(dev);
    if (PyErr_Occurred())
        Py_CLEAR(out);
done:
    Py_DECREF(kseq);
    Py_DECREF(iseq);
    return out;
}

static PyObject *
Core_mark_computed(CoreObject *c, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "mark_computed takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *policy = c->policy[0];
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        n->state[0] = READY;
        if (!c->orders_referenced[0])
            continue;  /* the policy would ignore a referenced node until unref */
        if (c->lru[0]) {
            if (n->ref == 0 && !LINKED(c->lru[0], n))
                lru_append(c->lru[0], n);
            continue;
        }
        PyObject *r = PyObject_CallMethodOneArg(policy, s_insert, (PyObject *)n);
        if (r == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Core_release(CoreObject *c, PyObject *arg)
{
    PyObject *seq = node_seq(arg, "release takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *released = PyList_New(0);
    if (released == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        Py_ssize_t r = n->ref - 1;
        if (r < 0) {
            n->ref = 0;
            PyErr_Format(PyExc_AssertionError, "ref count of %R would go negative",
                         (PyObject *)n);
            goto fail;
        }
        n->ref = r;
        if (r == 0 && PyList_Append(released, (PyObject *)n) < 0)
            goto fail;
    }
    Py_ssize_t nrel = PyList_GET_SIZE(released);
    for (int t = 0; t < NTIERS && nrel; t++) {
        if (!c->active[t])
            continue;
        Py_ssize_t ready = 0;
        if (c->lru[t]) {
            for (Py_ssize_t i = 0; i < nrel; i++) {
                NodeObject *n = (NodeObject *)PyList_GET_ITEM(released, i);
                if (n->state[t] == READY) {
                    ready++;
                    if (!LINKED(c->lru[t], n))
                        lru_append(c->lru[t], n);
                }
            }
        }
        else {
            PyObject *list = PyList_New(0);
            if (list == NULL)
                goto fail;
            for (Py_ssize_t i = 0; i < nrel; i++) {
                PyObject *n = PyList_GET_ITEM(released, i);
                if (((NodeObject *)n)->state[t] == READY && PyList_Append(list, n) < 0) {
                    Py_DECREF(list);
                    goto fail;
                }
            }
            ready = PyList_GET_SIZE(list);
            if (ready) {
                PyObject *r = PyObject_CallMethodOneArg(c->policy[t], s_unref_all, list);
                if (r == NULL) {
                    Py_DECREF(list);
                    goto fail;
                }
                Py_DECREF(r);
            }
            Py_DECREF(list);
        }
        if (core_add_unreferenced(c, t, ready) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return released;
fail:
    Py_DECREF(seq);
    Py_XDECREF(released);
    return NULL;
}

/* Drop ``tier``'s copy of a victim taken from the front of the order, if it may go.
 * Returns 1 (dropped; its block id appended to ids), 0 (may not go), -1 (error). */
static int
core_drop_victim(CoreObject *c, NodeObject *n, int tier, PyObject *ids)
{
    static const int other[NTIERS][2] = {{1, 2}, {0, 2}, {0, 1}};
    if (n->ref || n->state[tier] != READY)
        return 0;
    int sa = n->state[other[tier][0]], sb = n->state[other[tier][1]];
    int last = sa == ABSENT && sb == ABSENT;
    if (last ? n->children != 0 : (n->children && !USABLE(sa) && !USABLE(sb)))
        return 0;  /* a parent of cached nodes, or its only other copy is being computed */
    PyObject *id = PyLong_FromLong(n->loc[tier]);
    if (id == NULL)
        return -1;
    if (PyList_Append(ids, id) < 0) {
        Py_DECREF(id);
        return -1;
    }
    Py_DECREF(id);
    n->loc[tier] = -1;
    n->state[tier] = ABSENT;
    if (n->inflight && PyList_Check(n->inflight) && PyList_GET_SIZE(n->inflight) == NTIERS)
        PyList_SetItem(n->inflight, tier, Py_NewRef(Py_None));
    if (last) {  /* its last copy: the node goes */
        if (n->parent)
            n->parent->children--;
        if (PyDict_DelItem(c->nodes, n->key) < 0)
            return -1;
    }
    return 1;
}

static PyObject *
Core_drop_front(CoreObject *c, PyObject *args)
{
    int tier;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "in:drop_front", &tier, &count))
        return NULL;
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
    PyObject *ids = PyList_New(0);
    if (ids == NULL || count <= 0)  /* as index_core: a count of 0 or less drops nothing */
        return ids;
    LRUObject *lru = c->lru[tier];
    if (lru) {
        while (PyList_GET_SIZE(ids) < count && lru->head) {
            NodeObject *n = lru->head;
            Py_INCREF(n);  /* ours while we look at it */
            int r = core_drop_victim(c, n, tier, ids);
            if (r == 1) {
                lru_unlink(lru, n);
                Py_DECREF(n);  /* the list's reference */
            }
            Py_DECREF(n);
            if (r < 0)
                goto fail;
            if (r == 0)
                break;
        }
    }
    else {
        PyObject *policy = c->policy[tier];
        PyObject *k_obj = PyLong_FromSsize_t(count);
        PyObject *taken = k_obj ? PyObject_CallMethodOneArg(policy, s_pop_front, k_obj) : NULL;
        Py_XDECREF(k_obj);
        if (taken == NULL)
            goto fail;
        if (!PyList_Check(taken)) {
            Py_DECREF(taken);
            PyErr_SetString(PyExc_TypeError, "pop_front must return a list");
            goto fail;
        }
        Py_ssize_t k = PyList_GET_SIZE(taken), i = 0;
        for (; i < k; i++) {
            PyObject *n = PyList_GET_ITEM(taken, i);
            int r = node_check(n) < 0 ? -1 : core_drop_victim(c, (NodeObject *)n, tier, ids);
            if (r < 0) {
                Py_DECREF(taken);
                goto fail;
            }
            if (r == 0)
                break;
        }
        if (i < k) {
            PyObject *rest = PyList_GetSlice(taken, i, k);
            PyObject *r = rest ? PyObject_CallMethodOneArg(policy, s_push_front, rest) : NULL;
            Py_XDECREF(rest);
            if (r == NULL) {
                Py_DECREF(taken);
                goto fail;
            }
            Py_DECREF(r);
        }
        Py_DECREF(taken);
    }
    if (core_add_unreferenced(c, tier, -PyList_GET_SIZE(ids)) < 0)
        goto fail;
    return ids;
fail:
    Py_DECREF(ids);
    return NULL;
}

/* ``PrefixIndex.can_lose(node, tier)`` (no copy down). */
static int
core_can_lose(NodeObject *n, int tier)
{
    static const int other[NTIERS][2] = {{1, 2}, {0, 2}, {0, 1}};
    if (n->ref || n->state[tier] != READY)
        return 0;
    return n->children == 0 || USABLE(n->state[other[tier][0]]) ||
           USABLE(n->state[other[tier][1]]);
}

/* ``PrefixIndex.drop_copy(node, tier)`` of a READY copy, its block id appended to
 * ``ids``; ``delta`` counts the unreferenced copies gone. 0, or -1 on an error. */
static int
core_drop_copy(CoreObject *c, NodeObject *n, int tier, PyObject *ids, Py_ssize_t *delta)
{
    LRUObject *lru = c->lru[tier];
    if (lru) {
        if (LINKED(lru, n)) {
            lru_unlink(lru, n);
            Py_DECREF(n);
        }
    }
    else {
        PyObject *r = PyObject_CallMethodOneArg(c->policy[tier], s_remove, (PyObject *)n);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    if (n->ref == 0)
        (*delta)++;
    PyObject *id = PyLong_FromLong(n->loc[tier]);
    if (id == NULL || PyList_Append(ids, id) < 0) {
        Py_XDECREF(id);
        return -1;
    }
    Py_DECREF(id);
    n->loc[tier] = -1;
    n->state[tier] = ABSENT;
    if (n->inflight && PyList_Check(n->inflight) && PyList_GET_SIZE(n->inflight) == NTIERS)
        PyList_SetItem(n->inflight, tier, Py_NewRef(Py_None));
    if (n->state[0] == ABSENT && n->state[1] == ABSENT && n->state[2] == ABSENT) {
        if (n->children != 0) {
            PyErr_Format(PyExc_AssertionError, "%R", (PyObject *)n);
            return -1;
        }
        if (n->parent)
            n->parent->children--;
        if (PyDict_DelItem(c->nodes, n->key) < 0)
            return -1;
    }
    return 0;
}

/* One pass of ``PrefixIndex.victims(tier)`` (no copy down), each victim dropped as
 * it comes, until ``ids`` holds ``count``. Returns how many it dropped, or -1. */
static Py_ssize_t
core_victims_pass(CoreObject *c, int tier, Py_ssize_t count, PyObject *ids, Py_ssize_t *delta)
{
    PyObject *policy = c->policy[tier];
    Py_ssize_t dropped = 0;
    /* The policy's O(1) first while it can lose it. */
    for (;;) {
        PyObject *o = PyObject_CallMethodNoArgs(policy, s_first);
        if (o == NULL)
            return -1;
        if (o == Py_None) {
            Py_DECREF(o);
            break;
        }
        if (node_check(o) < 0) {
            Py_DECREF(o);
            return -1;
        }
        NodeObject *n = (NodeObject *)o;
        if (!core_can_lose(n, tier)) {
            Py_DECREF(o);
            break;
        }
        int r = core_drop_copy(c, n, tier, ids, delta);
        Py_DECREF(o);
        if (r < 0)
            return -1;
        dropped++;
        if (PyList_GET_SIZE(ids) >= count)
            return dropped;
    }
    /* Then the full scan. */
    PyObject *cands = PyObject_CallMethodNoArgs(policy, s_candidates);
    if (cands == NULL)
        return -1;
    PyObject *it = PyObject_GetIter(cands);
    Py_DECREF(cands);
    if (it == NULL)
        return -1;
    PyObject *o;
    while ((o = PyIter_Next(it)) != NULL) {
        if (node_check(o) < 0) {
            Py_DECREF(o);
            Py_DECREF(it);
            return -1;
        }
        NodeObject *n = (NodeObject *)o;
        if (core_can_lose(n, tier)) {
            int r = core_drop_copy(c, n, tier, ids, delta);
            if (r < 0) {
                Py_DECREF(o);
                Py_DECREF(it);
                return -1;
            }
            dropped++;
            if (PyList_GET_SIZE(ids) >= count) {
                Py_DECREF(o);
                break;  /* the scan is left where it stands (closed, as a broken loop) */
            }
        }
        Py_DECREF(o);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return -1;
    return dropped;
}

static PyObject *
Core_take_victims(CoreObject *c, PyObject *args)
{
    int tier;
    Py_ssize_t count;
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "inO!:take_victims", &tier, &count, &PyList_Type, &ids))
        return NULL;
    if (tier < 0 || tier >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0..2, got %d", tier);
        return NULL;
    }
    Py_ssize_t delta = 0;
    while (PyList_GET_SIZE(ids) < count) {
        Py_ssize_t d = core_victims_pass(c, tier, count, ids, &delta);
        if (d < 0) {
            PyObject *et, *ev, *tb;  /* keep the counts true to what was done */
            PyErr_Fetch(&et, &ev, &tb);
            core_add_unreferenced(c, tier, -delta);
            PyErr_Restore(et, ev, tb);
            return NULL;
        }
        if (d == 0)
            break;
    }
    if (core_add_unreferenced(c, tier, -delta) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"match", (PyCFunction)Core_match, METH_O, NULL},
    {"ref_all", (PyCFunction)Core_ref_all, METH_O, NULL},
    {"best_tiers", (PyCFunction)Core_best_tiers, METH_O, NULL},
    {"computing_on_device", (PyCFunction)Core_computing_on_device, METH_O, NULL},
    {"add_computing", (PyCFunction)(void (*)(void))Core_add_computing,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"mark_computed", (PyCFunction)Core_mark_computed, METH_O, NULL},
    {"release", (PyCFunction)Core_release, METH_O, NULL},
    {"drop_front", (PyCFunction)Core_drop_front, METH_VARARGS, NULL},
    {"take_victims", (PyCFunction)Core_take_victims, METH_VARARGS,
     "CacheManager._take_victims with no copy down: victims dropped until ``ids`` "
     "(a list, appended to) holds ``count``, pass after pass while one drops any."},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow._index_core.Core",
    .tp_doc = "The per-request loops of PrefixIndex (see index_core.Core for each one's "
              "contract).",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Core_tp_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
};

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

/* ---------------------------------------------------------------- module */

static int
check_constant(PyObject *mod, const char *name, long want)
{
    PyObject *v = PyObject_GetAttrString(mod, name);
    if (v == NULL)
        return -1;
    long got = PyLong_AsLong(v);
    Py_DECREF(v);
    if (got == -1 && PyErr_Occurred())
        return -1;
    if (got != want) {
        PyErr_Format(PyExc_ImportError,
                     "kvflow._index_core was built for %s=%ld, index_core has %ld: rebuild it",
                     name, want, got);
        return -1;
    }
    return 0;
}

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvflow._index_core",
    .m_doc = "Native per-request loops of the prefix index (see kvflow/index_core.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__index_core(void)
{
    PyObject *ref = PyImport_ImportModule("kvflow.index_core");
    if (ref == NULL)
        return NULL;
    if (check_constant(ref, "ABSENT", ABSENT) < 0 || check_constant(ref, "READY", READY) < 0 ||
        check_constant(ref, "FILLING", FILLING) < 0 ||
        check_constant(ref, "COMPUTING", COMPUTING) < 0) {
        Py_DECREF(ref);
        return NULL;
    }
    NO_INFLIGHT = PyObject_GetAttrString(ref, "NO_INFLIGHT");
    PyObject *names = PyObject_GetAttrString(ref, "STATE_NAMES");
    TIER_NAMES = PyObject_GetAttrString(ref, "TIER_NAMES");
    Py_DECREF(ref);
    if (NO_INFLIGHT == NULL || names == NULL || TIER_NAMES == NULL) {
        Py_XDECREF(names);
        return NULL;
    }
    /* STATE_NAMES is a dict state -> name; keep it as a tuple indexed by state. */
    STATE_NAMES = PyTuple_New(4);
    for (long s = 0; STATE_NAMES && s < 4; s++) {
        PyObject *k = PyLong_FromLong(s);
        PyObject *v = k ? PyObject_GetItem(names, k) : NULL;
        Py_XDECREF(k);
        if (v == NULL) {
            Py_CLEAR(STATE_NAMES);
            break;
        }
        PyTuple_SET_ITEM(STATE_NAMES, s, v);
    }
    Py_DECREF(names);
    if (STATE_NAMES == NULL || !PyTuple_Check(TIER_NAMES) || PyTuple_GET_SIZE(TIER_NAMES) != 3) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ImportError, "index_core.TIER_NAMES must be a 3-tuple");
        return NULL;
    }
    if (!(s_ref = PyUnicode_InternFromString("ref")) ||
        !(s_insert = PyUnicode_InternFromString("insert")) ||
        !(s_unref_all = PyUnicode_InternFromString("unref_all")) ||
        !(s_pop_front = PyUnicode_InternFromString("pop_front")) ||
        !(s_push_front = PyUnicode_InternFromString("push_front")) ||
        !(s_orders_referenced = PyUnicode_InternFromString("orders_referenced")) ||
        !(s_popitem = PyUnicode_InternFromString("popitem")) ||
        !(s_remove = PyUnicode_InternFromString("remove")) ||
        !(s_first = PyUnicode_InternFromString("first")) ||
        !(s_candidates = PyUnicode_InternFromString("candidates")))
        return NULL;
    if (PyType_Ready(&NodeType) < 0 || PyType_Ready(&TripleType) < 0 ||
        PyType_Ready(&LRUType) < 0 || PyType_Ready(&BucketsType) < 0 ||
        PyType_Ready(&CoreType) < 0 || PyType_Ready(&AccessLogType) < 0 ||
        PyType_Ready(&ARCType) < 0 || PyType_Ready(&S3Type) < 0 ||
        PyType_Ready(&S3ScanType) < 0 || PyType_Ready(&CostType) < 0 ||
        PyType_Ready(&CostScanType) < 0)
        return NULL;
    if (PyDict_SetItemString(LRUType.tp_dict, "orders_referenced", Py_False) < 0 ||
        PyDict_SetItemString(BucketsType.tp_dict, "orders_referenced", Py_False) < 0 ||
        PyDict_SetItemString(ARCType.tp_dict, "orders_referenced", Py_False) < 0 ||
        PyDict_SetItemString(S3Type.tp_dict, "orders_referenced", Py_True) < 0 ||
        PyDict_SetItemString(CostType.tp_dict, "orders_referenced", Py_False) < 0)
        return NULL;
    PyType_Modified(&CostType);
    PyType_Modified(&S3Type);
    PyType_Modified(&ARCType);
    PyType_Modified(&LRUType);
    PyType_Modified(&BucketsType);
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Node", (PyObject *)&NodeType) < 0 ||
        PyModule_AddObjectRef(m, "LinkedLRU", (PyObject *)&LRUType) < 0 ||
        PyModule_AddObjectRef(m, "LinkedBuckets", (PyObject *)&BucketsType) < 0 ||
        PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddObjectRef(m, "AccessLog", (PyObject *)&AccessLogType) < 0 ||
        PyModule_AddObjectRef(m, "LinkedARC", (PyObject *)&ARCType) < 0 ||
        PyModule_AddObjectRef(m, "LinkedS3FIFO", (PyObject *)&S3Type) < 0 ||
        PyModule_AddObjectRef(m, "LinkedCost", (PyObject *)&CostType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
