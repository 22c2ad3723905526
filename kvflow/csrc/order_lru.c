/* LinkedLRU: one tier's LRU order linked through the nodes.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

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
    Py_INCREF(n);
    list_push_back(&o->head, &o->tail, n, o->tier);
    o->size++;
}

static void
lru_prepend(LRUObject *o, NodeObject *n)
{
    Py_INCREF(n);
    list_push_front(&o->head, &o->tail, n, o->tier);
    o->size++;
}

/* Unlink; the caller inherits the list's reference. */
static void
lru_unlink(LRUObject *o, NodeObject *n)
{
    list_unlink(&o->head, &o->tail, n, o->tier);
    o->size--;
}

static PyObject *
LRU_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", NULL};
    int tier;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:LinkedLRU", kwlist, &tier))
        return NULL;
    if (check_tier(tier) < 0)
        return NULL;
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
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
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
    return list_as_pylist(o->head, o->size, o->tier);
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
