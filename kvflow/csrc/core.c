/* Core: the prefix index's per-request loops (match, ref, release, ...).
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

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


/* Defined in core_victims.c and core_bulk.c (included next). */
static PyObject *Core_drop_front(CoreObject *c, PyObject *args);
static PyObject *Core_take_victims(CoreObject *c, PyObject *args);
static PyObject *Core_land(CoreObject *c, PyObject *args);
static PyObject *Core_backups(CoreObject *c, PyObject *args);
static PyObject *Core_fill(CoreObject *c, PyObject *args);
static PyObject *Core_columns(CoreObject *c, PyObject *args);
static PyObject *Core_set_inflight_all(CoreObject *c, PyObject *args);
static PyObject *Core_admit(CoreObject *c, PyObject *args);

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
    {"land", (PyCFunction)Core_land, METH_VARARGS, NULL},
    {"backups", (PyCFunction)Core_backups, METH_VARARGS, NULL},
    {"fill", (PyCFunction)Core_fill, METH_VARARGS, NULL},
    {"columns", (PyCFunction)Core_columns, METH_VARARGS, NULL},
    {"set_inflight_all", (PyCFunction)Core_set_inflight_all, METH_VARARGS, NULL},
    {"admit", (PyCFunction)Core_admit, METH_VARARGS, NULL},
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
