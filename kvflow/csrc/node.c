/* Node, the prefix index's node as a C struct, and Triple, match's result.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* ------------------------------------------------------------------ Node */

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

/* ``arg`` as a node on tier ``tier``'s native order: NULL with TypeError if it is no
 * Node, KeyError if it is not on the order (as the Python orders' dicts raise). */
static inline NodeObject *
node_ordered(PyObject *arg, int tier)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    if (!((n->linked >> tier) & 1)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    return n;
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
