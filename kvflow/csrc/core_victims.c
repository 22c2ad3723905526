/* Core's eviction loops: drop_front and take_victims.
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

/* Append the block id of ``n``'s copy on ``tier`` to ``ids`` and mark the copy gone
 * (absent, no op in flight on it). 0, or -1 on an error (nothing changed). */
static inline int
core_forget_copy(NodeObject *n, int tier, PyObject *ids)
{
    PyObject *id = PyLong_FromLong(n->loc[tier]);
    if (id == NULL)
        return -1;
    int r = PyList_Append(ids, id);
    Py_DECREF(id);
    if (r < 0)
        return -1;
    n->loc[tier] = -1;
    n->state[tier] = ABSENT;
    if (n->inflight && PyList_Check(n->inflight) && PyList_GET_SIZE(n->inflight) == NTIERS)
        PyList_SetItem(n->inflight, tier, Py_NewRef(Py_None));
    return 0;
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
    if (core_forget_copy(n, tier, ids) < 0)
        return -1;
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
    if (check_tier(tier) < 0)
        return NULL;
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
    if (core_forget_copy(n, tier, ids) < 0)
        return -1;
    /* As set_inflight(node, tier, None): a node keeps no list once nothing is in flight
     * (drop_front's reference clears the slot only, and so does core_forget_copy). */
    if (n->inflight && PyList_CheckExact(n->inflight) && PyList_GET_SIZE(n->inflight) == NTIERS
            && PyList_GET_ITEM(n->inflight, 0) == Py_None
            && PyList_GET_ITEM(n->inflight, 1) == Py_None
            && PyList_GET_ITEM(n->inflight, 2) == Py_None)
        Py_CLEAR(n->inflight);
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

/* core_victims_pass over a LinkedLRU, without calling back: its ``first`` is the
 * head, and its ``candidates`` (policy.LinkedLRU) offers the head len(order) times,
 * moving each one still ordered after it was offered to the end. */
static Py_ssize_t
lru_victims_pass(CoreObject *c, LRUObject *lru, int tier, Py_ssize_t count, PyObject *ids,
                 Py_ssize_t *delta)
{
    Py_ssize_t dropped = 0;
    while (lru->head && core_can_lose(lru->head, tier)) {
        if (core_drop_copy(c, lru->head, tier, ids, delta) < 0)
            return -1;
        dropped++;
        if (PyList_GET_SIZE(ids) >= count)
            return dropped;
    }
    Py_ssize_t scan = lru->size;
    for (Py_ssize_t i = 0; i < scan && lru->head; i++) {
        NodeObject *n = (NodeObject *)Py_NewRef(lru->head);
        if (core_can_lose(n, tier)) {
            if (core_drop_copy(c, n, tier, ids, delta) < 0) {
                Py_DECREF(n);
                return -1;
            }
            dropped++;
            if (PyList_GET_SIZE(ids) >= count) {
                Py_DECREF(n);
                break;  /* (the scan closed where it stands) */
            }
        }
        if (LINKED(lru, n)) {  /* move_to_end */
            lru_unlink(lru, n);
            lru_append(lru, n);
            Py_DECREF(n);  /* (the list's old reference: append took a new one) */
        }
        Py_DECREF(n);
    }
    return dropped;
}

/* One pass of ``PrefixIndex.victims(tier)`` (no copy down), each victim dropped as
 * it comes, until ``ids`` holds ``count``. Returns how many it dropped, or -1. */
static Py_ssize_t
core_victims_pass(CoreObject *c, int tier, Py_ssize_t count, PyObject *ids, Py_ssize_t *delta)
{
    PyObject *policy = c->policy[tier];
    Py_ssize_t dropped = 0;
    LRUObject *lru = c->lru[tier];
    if (lru)
        return lru_victims_pass(c, lru, tier, count, ids, delta);
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
    if (check_tier(tier) < 0)
        return NULL;
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
