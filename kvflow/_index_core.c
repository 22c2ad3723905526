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
 *
 * Layout: one translation unit (a unity build: one compile, and the hot paths
 * inline across parts as they did when this was one file), its parts in
 * kvflow/csrc/, included below in dependency order, each listed in pyproject's
 * ``depends`` (tests/test_index_core.py checks both):
 *   index_core.h        copy states, interned names, the node's layout, the
 *                       intrusive node lists and rank buckets the orders share
 *   node.c              Node and Triple (match's result)
 *   order_lru.c         LinkedLRU
 *   order_buckets.c     LinkedBuckets (length-aware, LFU)
 *   ghosts.c            ghost lists of evicted keys (ARC's B1/B2, S3-FIFO's)
 *   order_arc.c         LinkedARC
 *   order_s3fifo.c      LinkedS3FIFO and its candidates scan
 *   order_cost.c        LinkedCost (CostAware, GDSF)
 *   order_cost_evict.c  LinkedCost's first, pop_front, push_front and candidates scan
 *   core.c              Core: match, ref, release and the other per-request loops
 *   core_victims.c      Core's drop_front and take_victims
 *   core_bulk.c         Core's per-op loops: an op's columns, in-flight marks, fills,
 *                       landing; a request's use of its hits; backup candidates
 *   access_log.c        AccessLog: a trace's accesses, compact (headroom)
 *   access_log_belady.c AccessLog.hits: Belady's MIN over them
 * This file keeps the module's init.
 */

#include "csrc/index_core.h"

#include "csrc/node.c"
#include "csrc/order_lru.c"
#include "csrc/order_buckets.c"
#include "csrc/ghosts.c"
#include "csrc/order_arc.c"
#include "csrc/order_s3fifo.c"
#include "csrc/order_cost.c"
#include "csrc/order_cost_evict.c"
#include "csrc/core.c"
#include "csrc/core_victims.c"
#include "csrc/core_bulk.c"
#include "csrc/access_log.c"
#include "csrc/access_log_belady.c"

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
