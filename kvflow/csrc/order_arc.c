/* LinkedARC: ARC's T1 and T2 linked through the nodes.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

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
    PyObject_HEAD
    int tier;
    Py_ssize_t capacity;
    double p;
    NodeList l[3];          /* l[1]: T1, l[2]: T2 */
    Ghosts b[3];            /* b[1], b[2]: B1 and B2 */
    char *popped;           /* where the last pop_front's victims were, in order */
    Py_ssize_t npopped, popcap;
} ARCObject;

static PyTypeObject ARCType;

static void
arc_append(ARCObject *o, NodeObject *n, int w)
{
    int t = o->tier;
    NodeList *l = &o->l[w];
    Py_INCREF(n);
    n->rank[t] = w;
    list_push_back(&l->head, &l->tail, n, t);
    l->size++;
}

static void
arc_prepend(ARCObject *o, NodeObject *n, int w)
{
    int t = o->tier;
    NodeList *l = &o->l[w];
    Py_INCREF(n);
    n->rank[t] = w;
    list_push_front(&l->head, &l->tail, n, t);
    l->size++;
}

/* Unlink a linked node (rank[t] is left as the list it was in); the caller
 * inherits the list's reference. */
static void
arc_unlink(ARCObject *o, NodeObject *n)
{
    int t = o->tier;
    NodeList *l = &o->l[n->rank[t]];
    list_unlink(&l->head, &l->tail, n, t);
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
    if (check_tier(tier) < 0)
        return NULL;
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
    if (LINKED(o, n))  /* ordered already: as ``od[node] = None``, it stays put */
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
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
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
    if (LINKED(o, n)) {
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
        if (LINKED(o, n)) {
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
    NodeObject *n = node_ordered(arg, o->tier);
    if (n == NULL)
        return NULL;
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
    return PyLong_FromLong(LINKED(o, n) ? (long)n->rank[o->tier] : 0);
}

static PyObject *
ARC_held(ARCObject *o, PyObject *arg)
{
    if (node_check(arg) < 0)
        return NULL;
    NodeObject *n = (NodeObject *)arg;
    return PyLong_FromLong(LINKED(o, n) ? 0 : (long)n->rank[o->tier]);
}

static PyObject *
ARC_victim_list(ARCObject *o, PyObject *unused)
{
    return PyLong_FromLong(arc_victim_list(o));
}

static PyObject *
arc_as_list(ARCObject *o, int w)
{
    return list_as_pylist(o->l[w].head, o->l[w].size, o->tier);
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
        if (list_add_to_set(s, o->l[w].head, o->tier) < 0)
            Py_CLEAR(s);
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
