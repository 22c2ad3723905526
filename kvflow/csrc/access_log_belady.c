/* AccessLog.hits: Belady's MIN over a finished AccessLog's arrays (the headroom's
 * offline optimum).
 *
 * Part of kvflow._index_core, one translation unit: kvflow/_index_core.c includes
 * the parts in dependency order; not compiled on its own. */

#include "index_core.h"

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
