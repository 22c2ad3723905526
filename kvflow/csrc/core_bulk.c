/* Core's per-op loops: what the manager does to every block of a copy (the op's
 * columns, its in-flight marks, the copies it fills, their landing) and to every
 * block a request uses (``admit``) or backs up.
 *
 * Before these, each loop ran in Python in the manager, and each ``node.state[t]``
 * there made a Triple: a cache-mode replay spent most of its time on them
 * (benchmarks/results/replay_speed.md). kvflow/index_core.py holds the same loops
 * in Python, the reference the tests hold these to.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* A node's in-flight op on ``tier`` (borrowed; Py_None when none), or NULL on an error. */
static inline PyObject *
node_inflight_get(NodeObject *n, int tier)
{
    if (n->inflight == NULL)
        return Py_None;
    if (PyList_CheckExact(n->inflight) && PyList_GET_SIZE(n->inflight) == NTIERS)
        return PyList_GET_ITEM(n->inflight, tier);
    PyObject *v = PySequence_GetItem(n->inflight, tier);
    Py_XDECREF(v);  /* (the sequence keeps it) */
    return v;
}

/* land(op, nodes, dst): index_core.Core.land. */
static PyObject *
Core_land(CoreObject *c, PyObject *args)
{
    PyObject *op, *nodes;
    int dst;
    if (!PyArg_ParseTuple(args, "OOi:land", &op, &nodes, &dst))
        return NULL;
    if (check_tier(dst) < 0)
        return NULL;
    if (op == Py_None) {
        PyErr_SetString(PyExc_ValueError, "land takes an op, not None");
        return NULL;
    }
    PyObject *seq = node_seq(nodes, "land takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *landed = PyList_New(0);
    Py_ssize_t delta[NTIERS] = {0, 0, 0};
    LRUObject *lru = c->lru[dst];
    int err = landed == NULL;
    for (Py_ssize_t i = len - 1; i >= 0 && !err; i--) {  /* tail-first */
        NodeObject *n = (NodeObject *)items[i];
        if (n->state[dst] != FILLING)
            continue;
        PyObject *fl = node_inflight_get(n, dst);
        if (fl == NULL) {
            err = 1;
            break;
        }
        if (fl != op)
            continue;
        n->state[dst] = READY;
        if (PySequence_SetItem(n->inflight, dst, Py_None) < 0) {
            err = 1;
            break;
        }
        if (PyList_CheckExact(n->inflight) && PyList_GET_ITEM(n->inflight, 0) == Py_None
                && PyList_GET_ITEM(n->inflight, 1) == Py_None
                && PyList_GET_ITEM(n->inflight, 2) == Py_None)
            Py_CLEAR(n->inflight);  /* reads as NO_INFLIGHT again */
        if (lru) {
            if (n->ref == 0 && !LINKED(lru, n))
                lru_append(lru, n);
        }
        else {
            PyObject *r = PyObject_CallMethodOneArg(c->policy[dst], s_insert, (PyObject *)n);
            if (r == NULL) {
                err = 1;
                break;
            }
            Py_DECREF(r);
        }
        if (n->ref == 0)
            delta[dst]++;
        if (PyList_Append(landed, (PyObject *)n) < 0)
            err = 1;
    }
    Py_DECREF(seq);
    if (err) {  /* keep the counts true to what was done */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        core_apply(c, delta);
        PyErr_Restore(et, ev, tb);
        Py_XDECREF(landed);
        return NULL;
    }
    if (core_apply(c, delta) < 0 || PyList_Reverse(landed) < 0) {
        Py_DECREF(landed);
        return NULL;
    }
    return landed;
}

/* backups(nodes, lower, ready, min_hits): index_core.Core.backups. */
static PyObject *
Core_backups(CoreObject *c, PyObject *args)
{
    PyObject *nodes;
    int lower, ready;
    Py_ssize_t min_hits;
    if (!PyArg_ParseTuple(args, "Oiin:backups", &nodes, &lower, &ready, &min_hits))
        return NULL;
    if (check_tier(lower) < 0 || (ready != -1 && check_tier(ready) < 0))
        return NULL;
    PyObject *seq = node_seq(nodes, "backups takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        if (n->state[lower] == ABSENT && (ready < 0 || n->state[ready] == READY)
                && n->hits >= min_hits && PyList_Append(out, (PyObject *)n) < 0)
            Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}

/* fill(nodes, tier, ids): index_core.Core.fill. */
static PyObject *
Core_fill(CoreObject *c, PyObject *args)
{
    PyObject *nodes, *ids;
    int tier;
    if (!PyArg_ParseTuple(args, "OiO:fill", &nodes, &tier, &ids))
        return NULL;
    if (check_tier(tier) < 0)
        return NULL;
    PyObject *seq = node_seq(nodes, "fill takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    PyObject *iseq = PySequence_Fast(ids, "fill takes a sequence of block ids");
    if (iseq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject **iitems = PySequence_Fast_ITEMS(iseq);
    PyObject *r = NULL;
    if (PySequence_Fast_GET_SIZE(iseq) != len) {
        PyErr_Format(PyExc_ValueError, "fill: %zd nodes but %zd block ids", len,
                     PySequence_Fast_GET_SIZE(iseq));
        goto done;
    }
    for (Py_ssize_t i = 0; i < len; i++) {  /* all checked first: all or nothing */
        NodeObject *n = (NodeObject *)items[i];
        if (n->state[tier] != ABSENT) {
            PyErr_Format(PyExc_AssertionError, "fill: %R already has a copy on tier %d",
                         (PyObject *)n, tier);
            goto done;
        }
        long v = PyLong_AsLong(iitems[i]);
        if (v == -1 && PyErr_Occurred())
            goto done;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        n->loc[tier] = PyLong_AsLong(iitems[i]);
        n->state[tier] = FILLING;
    }
    r = Py_NewRef(Py_None);
done:
    Py_DECREF(seq);
    Py_DECREF(iseq);
    return r;
}

/* A new list of the nodes' block ids on ``tier``, or NULL. */
static PyObject *
nodes_locs(PyObject **items, Py_ssize_t len, int tier)
{
    PyObject *out = PyList_New(len);
    for (Py_ssize_t i = 0; out && i < len; i++) {
        PyObject *v = PyLong_FromLong(((NodeObject *)items[i])->loc[tier]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* columns(nodes, src, dst): index_core.Core.columns. */
static PyObject *
Core_columns(CoreObject *c, PyObject *args)
{
    PyObject *nodes;
    int src, dst;
    if (!PyArg_ParseTuple(args, "Oii:columns", &nodes, &src, &dst))
        return NULL;
    if (check_tier(src) < 0 || check_tier(dst) < 0)
        return NULL;
    PyObject *seq = node_seq(nodes, "columns takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *s = nodes_locs(items, len, src);
    PyObject *d = s ? nodes_locs(items, len, dst) : NULL;
    PyObject *k = d ? PyList_New(len) : NULL;
    for (Py_ssize_t i = 0; k && i < len; i++)
        PyList_SET_ITEM(k, i, Py_NewRef(((NodeObject *)items[i])->key));
    Py_DECREF(seq);
    if (k == NULL) {
        Py_XDECREF(s);
        Py_XDECREF(d);
        return NULL;
    }
    PyObject *r = PyTuple_Pack(3, s, d, k);
    Py_DECREF(s);
    Py_DECREF(d);
    Py_DECREF(k);
    return r;
}

/* set_inflight_all(nodes, tier, op): index_core.Core.set_inflight_all. */
static PyObject *
Core_set_inflight_all(CoreObject *c, PyObject *args)
{
    PyObject *nodes, *op;
    int tier;
    if (!PyArg_ParseTuple(args, "OiO:set_inflight_all", &nodes, &tier, &op))
        return NULL;
    if (check_tier(tier) < 0)
        return NULL;
    if (op == Py_None) {
        PyErr_SetString(PyExc_ValueError, "set_inflight_all marks an op, not None");
        return NULL;
    }
    PyObject *seq = node_seq(nodes, "set_inflight_all takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        if (n->inflight == NULL) {
            PyObject *fl = PyList_New(NTIERS);
            if (fl == NULL) {
                Py_DECREF(seq);
                return NULL;
            }
            for (int t = 0; t < NTIERS; t++)
                PyList_SET_ITEM(fl, t, Py_NewRef(Py_None));
            n->inflight = fl;
        }
        if (PySequence_SetItem(n->inflight, tier, op) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* Pop the last int of the list ``l`` into ``*v``: 0, or -1 (IndexError as list.pop's). */
static inline int
pop_long(PyObject *l, long *v)
{
    Py_ssize_t k = PyList_GET_SIZE(l);
    if (k == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from empty list");
        return -1;
    }
    *v = PyLong_AsLong(PyList_GET_ITEM(l, k - 1));
    if (*v == -1 && PyErr_Occurred())
        return -1;
    return PyList_SetSlice(l, k - 1, k, NULL);
}

/* A FILLING copy of ``n`` on ``tier`` in the block popped from ``ids``: 0 or -1. */
static inline int
admit_fill(NodeObject *n, int tier, PyObject *ids, PyObject *device_ids)
{
    if (n->state[tier] != ABSENT) {
        PyErr_Format(PyExc_AssertionError, "admit: %R already has a copy on tier %d",
                     (PyObject *)n, tier);
        return -1;
    }
    long b;
    if (pop_long(ids, &b) < 0)
        return -1;
    if (device_ids) {
        PyObject *v = PyLong_FromLong(b);
        if (v == NULL || PyList_Append(device_ids, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    n->loc[tier] = b;
    n->state[tier] = FILLING;
    return 0;
}

/* admit(nodes, tiers, now, dev_ids, host_ids): index_core.Core.admit. */
static PyObject *
Core_admit(CoreObject *c, PyObject *args)
{
    PyObject *nodes, *tiers, *dev_ids, *host_ids;
    Py_ssize_t now;
    if (!PyArg_ParseTuple(args, "OOnO!O!:admit", &nodes, &tiers, &now, &PyList_Type, &dev_ids,
                          &PyList_Type, &host_ids))
        return NULL;
    PyObject *seq = node_seq(nodes, "admit takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    PyObject *tseq = PySequence_Fast(tiers, "admit takes a sequence of tiers");
    if (tseq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject **titems = PySequence_Fast_ITEMS(tseq);
    PyObject *out[5] = {NULL, NULL, NULL, NULL, NULL};  /* device_ids, from_host, staged,
                                                         * direct, waits */
    PyObject *r = NULL;
    if (PySequence_Fast_GET_SIZE(tseq) != len) {
        PyErr_Format(PyExc_ValueError, "admit: %zd nodes but %zd tiers", len,
                     PySequence_Fast_GET_SIZE(tseq));
        goto done;
    }
    for (int j = 0; j < 5; j++)
        if ((out[j] = PyList_New(0)) == NULL)
            goto done;
    for (Py_ssize_t i = 0; i < len; i++) {
        NodeObject *n = (NodeObject *)items[i];
        long t = PyLong_AsLong(titems[i]);
        if (t == -1 && PyErr_Occurred())
            goto done;
        n->hits++;
        n->last_access = now;
        int wait = 0;
        if (t == 0) {
            PyObject *v = PyLong_FromLong(n->loc[0]);
            if (v == NULL || PyList_Append(out[0], v) < 0) {
                Py_XDECREF(v);
                goto done;
            }
            Py_DECREF(v);
            wait = n->state[0] == FILLING;
        }
        else {
            if (admit_fill(n, 0, dev_ids, out[0]) < 0)
                goto done;
            PyObject *into;
            if (t == 1) {
                into = out[1];
                PyObject *fl = node_inflight_get(n, 1);
                if (fl == NULL)
                    goto done;
                wait = fl != Py_None;
            }
            else if (PyList_GET_SIZE(host_ids)) {
                if (admit_fill(n, 1, host_ids, NULL) < 0)
                    goto done;
                into = out[2];
            }
            else {
                into = out[3];
            }
            if (PyList_Append(into, (PyObject *)n) < 0)
                goto done;
        }
        if (wait) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL || PyList_Append(out[4], v) < 0) {
                Py_XDECREF(v);
                goto done;
            }
            Py_DECREF(v);
        }
    }
    r = PyTuple_Pack(5, out[0], out[1], out[2], out[3], out[4]);
done:
    for (int j = 0; j < 5; j++)
        Py_XDECREF(out[j]);
    Py_DECREF(seq);
    Py_DECREF(tseq);
    return r;
}
