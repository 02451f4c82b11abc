/* One rank's tp_agree round on the group control page, in C.

   peerd.pageagree.PageVoter drives it; the layout, the write order and why
   no rank reads half a round are Note [Control page layout] in
   peerd/controlpage.py, and every offset comes from there (the Voter is
   built with them), so this file holds no second copy of the layout.

   Why C: a round is a handful of loads, one store and one compare-and-swap.
   Done through ctypes from Python it cost 10-12 microseconds a call; here it
   costs what the cache lines cost, and the wait runs without the GIL, so a
   worker's other threads run while a rank waits for its peers.

   Built against the limited API (abi3): one build serves every Python from
   3.10 on. Linux only (FUTEX_WAIT on a shared page); GCC or Clang (the
   __atomic builtins), x86-64 or arm64. */

#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { AGREED = 1, VOTED_NO = 2, TIMED_OUT = 3, ABORTED = 4 };  /* peerd.controlpage.Outcome */

typedef struct {
    PyObject_HEAD
    char *base;                 /* the page, mapped by the caller, who keeps it mapped while this lives */
    unsigned long long npes, rank, rounds;
    unsigned long long off_wake, off_sleepers, off_abort, off_verdicts, ring, off_slots, slot_bytes;
    unsigned long long round_mask, round_bits;
    double spin_s, slice_s;     /* spin this long, then FUTEX_WAIT in slices of at most slice_s */
} Voter;

static inline uint64_t *word(Voter *v, unsigned long long off) { return (uint64_t *)(v->base + off); }
static inline uint32_t *word32(Voter *v, unsigned long long off) { return (uint32_t *)(v->base + off); }
static inline uint64_t load(Voter *v, unsigned long long off) { return __atomic_load_n(word(v, off), __ATOMIC_ACQUIRE); }
static inline unsigned long long slot(Voter *v, unsigned long long r) { return v->off_slots + v->slot_bytes * r; }
static inline unsigned long long entry(Voter *v, unsigned long long k) { return v->off_verdicts + 8 * (k % v->ring); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic()'s clock: deadlines come from Python */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The entry holds a later round than k: k's verdict was settled and its entry reused. */
static int behind(Voter *v, uint64_t w, unsigned long long k) {
    uint64_t ahead = ((w >> 24) - (k & v->round_mask)) & v->round_mask;
    return 0 < ahead && ahead < (1ULL << (v->round_bits - 1));
}

static int settled(Voter *v, uint64_t w, unsigned long long k) {
    return (w >> 24) == (k & v->round_mask) || behind(v, w, k);
}

static int all_voted(Voter *v, unsigned long long k) {
    for (unsigned long long r = 0; r < v->npes; r++)
        if (load(v, slot(v, r)) < k) return 0;
    return 1;
}

static int ready(Voter *v, unsigned long long k) {
    return settled(v, load(v, entry(v, k)), k) || all_voted(v, k) || load(v, v->off_abort) != 0;
}

/* Tell sleepers that something changed; the change was a sequentially consistent store or RMW. */
static void wake(Voter *v) {
    if (__atomic_load_n(word32(v, v->off_sleepers), __ATOMIC_SEQ_CST)) {
        __atomic_fetch_add(word32(v, v->off_wake), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, word32(v, v->off_wake), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

static void sleep_on_page(Voter *v, unsigned long long k, double seconds) {
    uint32_t seen = __atomic_load_n(word32(v, v->off_wake), __ATOMIC_SEQ_CST);
    __atomic_fetch_add(word32(v, v->off_sleepers), 1, __ATOMIC_SEQ_CST);
    if (!ready(v, k)) {
        struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
        syscall(SYS_futex, word32(v, v->off_wake), FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    __atomic_fetch_sub(word32(v, v->off_sleepers), 1, __ATOMIC_SEQ_CST);
}

/* Propose an outcome for round k; the first proposal wins, for every rank. The entry's word. */
static uint64_t settle(Voter *v, unsigned long long k, int outcome) {
    uint64_t *e = word(v, entry(v, k));
    uint64_t proposal = (k & v->round_mask) << 24 | (uint64_t)outcome << 16 | v->rank;
    uint64_t current = __atomic_load_n(e, __ATOMIC_ACQUIRE);
    while (!settled(v, current, k)) {
        if (__atomic_compare_exchange_n(e, &current, proposal, 0, __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE)) {
            if (outcome == TIMED_OUT || outcome == ABORTED) wake(v);  /* waiters learn it from the entry */
            break;
        }
    }
    return __atomic_load_n(e, __ATOMIC_ACQUIRE);
}

/* Wait until round k is ready, the deadline passes (0) or a signal handler raised (-1); GIL released. */
static int wait_round(Voter *v, unsigned long long k, double deadline) {
    int result = 1;
    PyThreadState *state = PyEval_SaveThread();
    double spin_until = now_s() + v->spin_s;
    for (;;) {
        if (ready(v, k)) break;
        double now = now_s();
        if (now >= deadline) { result = 0; break; }
        if (now < spin_until) { cpu_relax(); continue; }
        double slice = deadline - now < v->slice_s ? deadline - now : v->slice_s;
        sleep_on_page(v, k, slice);
        PyEval_RestoreThread(state);  /* between slices, so Ctrl-C reaches a long wait */
        if (PyErr_CheckSignals() < 0) return -1;
        state = PyEval_SaveThread();
    }
    PyEval_RestoreThread(state);
    return result;
}

/* agree(ok, deadline): vote in the next round; True, or the round's verdict word when it is not AGREED. */
static PyObject *voter_agree(Voter *v, PyObject *args) {
    int ok;
    double deadline;
    if (!PyArg_ParseTuple(args, "pd", &ok, &deadline)) return NULL;
    unsigned long long k = ++v->rounds, me = slot(v, v->rank);
    uint64_t bit = 1ULL << (k % 2);
    uint64_t votes = __atomic_load_n(word(v, me + 8), __ATOMIC_RELAXED);  /* one writer: this rank */
    __atomic_store_n(word(v, me + 8), (votes & ~bit) | (ok ? bit : 0), __ATOMIC_RELAXED);
    __atomic_store_n(word(v, me), (uint64_t)k, __ATOMIC_SEQ_CST);  /* the vote first, then the round */
    int everyone = all_voted(v, k);
    if (everyone) wake(v);  /* the last vote of the round: waiters may go */
    uint64_t verdict;
    int waited = 1;
    if (load(v, v->off_abort)) {
        verdict = settle(v, k, ABORTED);  /* an aborted group passes no round it had not settled */
    } else if (!everyone && !ready(v, k) && (waited = wait_round(v, k, deadline)) <= 0) {
        if (waited < 0) return NULL;  /* a signal handler raised; the vote stands, as a late rank's would */
        verdict = settle(v, k, TIMED_OUT);
    } else if (everyone || all_voted(v, k)) {
        int agreed = 1;  /* acquire loads of the rounds above: the ballots are round k's */
        for (unsigned long long r = 0; r < v->npes && agreed; r++)
            agreed = (load(v, slot(v, r) + 8) & bit) != 0;
        verdict = settle(v, k, agreed ? AGREED : VOTED_NO);
    } else {
        verdict = settle(v, k, ABORTED);  /* or round k was settled: its verdict stands */
    }
    if ((verdict >> 24) == (k & v->round_mask) && ((verdict >> 16) & 0xFF) == AGREED) Py_RETURN_TRUE;
    return PyLong_FromUnsignedLongLong(verdict);
}

static int voter_init(Voter *v, PyObject *args, PyObject *kwargs) {
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "KKK(KKKKKKKK)dd", &address, &v->npes, &v->rank, &v->off_wake, &v->off_sleepers,
                          &v->off_abort, &v->off_verdicts, &v->ring, &v->off_slots, &v->slot_bytes, &v->round_bits,
                          &v->spin_s, &v->slice_s))
        return -1;
    if (!address || v->rank >= v->npes || !v->ring || v->round_bits < 2 || v->round_bits > 40) {
        PyErr_SetString(PyExc_ValueError, "Voter(address, npes, rank, layout, spin_s, slice_s): bad arguments");
        return -1;
    }
    v->base = (char *)(uintptr_t)address;
    v->round_mask = (1ULL << v->round_bits) - 1;
    v->rounds = 0;
    return 0;
}

static PyMemberDef voter_members[] = {
    {"rounds", T_ULONGLONG, offsetof(Voter, rounds), READONLY, "rounds this voter has voted in"},
    {"spin_s", T_DOUBLE, offsetof(Voter, spin_s), 0, "seconds a waiting rank spins before it sleeps"},
    {NULL},
};

static PyMethodDef voter_methods[] = {
    {"agree", (PyCFunction)voter_agree, METH_VARARGS,
     "agree(ok, deadline): vote in the next round and wait for its verdict until monotonic `deadline`; "
     "True, or the round's verdict word"},
    {NULL},
};

static PyType_Slot voter_slots[] = {
    {Py_tp_doc, "Voter(address, npes, rank, layout, spin_s, slice_s): one rank's rounds on a mapped control page"},
    {Py_tp_init, voter_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_members, voter_members},
    {Py_tp_methods, voter_methods},
    {0, NULL},
};

static PyType_Spec voter_spec = {"peerd._pagevote.Voter", sizeof(Voter), 0, Py_TPFLAGS_DEFAULT, voter_slots};

static int module_exec(PyObject *module) {
    PyObject *type = PyType_FromSpec(&voter_spec);
    if (!type) return -1;
    if (PyModule_AddObject(module, "Voter", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "peerd._pagevote", "tp_agree's round on the control page (peerd.pageagree)", 0,
    NULL, module_slots,
};

PyMODINIT_FUNC PyInit__pagevote(void) { return PyModuleDef_Init(&module_def); }
