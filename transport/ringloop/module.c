/* The allreduce loop of one ring lane, in C: receive, add, forward, without the GIL.
 *
 * The Python loop in receiver.py costs a few tens of microseconds of interpreter time per
 * frame; on a host with more ranks than cores that is CPU taken from the other ranks. This
 * loop runs the same schedule (a LanePlan packed into int64 arrays) with the same threading
 * model as the Python one: the calling thread receives (blocking MSG_WAITALL reads, in
 * SO_RCVTIMEO slices), adds reduce-phase chunks into the tensor as they arrive, and queues the
 * frame each receive unlocks; a sender thread of its own writes the queue in order with
 * blocking writes, so sending never waits for receiving and a ring of these loops cannot
 * deadlock. While that thread is idle the receiving thread first writes a frame itself without
 * blocking, which saves a thread hand-off per chunk.
 *
 * Everything unusual is handed back to Python with a status, and Python raises the same
 * errors as its own loop: a frame with another prefix (an error frame, another op), a frame
 * out of schedule, contributor counts that differ, a timeout, EOF or a socket error, or an
 * exception raised by a signal handler. A frame half-written to the right neighbour when the
 * loop stops is returned too, so the lane's Python sender thread can complete it before it
 * appends the error frame.
 */
#include "ringloop.h"

#include <stdlib.h>

/* Run pending Python signal handlers (main thread only; a no-op elsewhere), as the Python loop
 * does between its system calls, so Ctrl-C or a SIGTERM handler is not held up for a timeout. */
int rl_check_signals(Loop *L) {
    PyEval_RestoreThread(L->ts);
    int r = PyErr_CheckSignals();
    if (r < 0) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        if (tb != NULL && v != NULL)
            PyException_SetTraceback(v, tb);
        Py_XDECREF(t);
        Py_XDECREF(tb);
        L->exc = v;
    }
    L->ts = PyEval_SaveThread();
    return r < 0 ? ST_INTERRUPTED : ST_OK;
}

static PyObject *allreduce_lane(PyObject *self, PyObject *args) {
    int lfd, rfd, contrib, dtype, world;
    Py_buffer buf, scratch, sends, recvs, pout, pin, ka;
    Py_ssize_t first_sends;
    double tmo, slice;
    if (!PyArg_ParseTuple(args, "iiw*w*y*ny*y*y*y*piidd", &lfd, &rfd, &buf, &scratch, &sends, &first_sends,
                          &recvs, &pout, &pin, &ka, &contrib, &dtype, &world, &tmo, &slice))
        return NULL;
    PyObject *result = NULL;
    Loop L;
    memset(&L, 0, sizeof L);
    if (pout.len != PREFIX_LEN || pin.len != PREFIX_LEN || ka.len != FRAME_LEN || sends.len % 32 || recvs.len % 48
        || (dtype != DT_F32 && dtype != DT_F64 && dtype != DT_I32 && dtype != DT_I64)) {
        PyErr_SetString(PyExc_ValueError, "allreduce_lane: bad arguments");
        goto out;
    }
    L.lfd = lfd;
    L.rfd = rfd;
    L.buf = buf.buf;
    L.scratch = scratch.buf;
    L.sends = sends.buf;
    L.nsends = sends.len / 32;
    L.first_sends = first_sends;
    L.recvs = recvs.buf;
    L.nrecvs = recvs.len / 48;
    L.prefix_out = pout.buf;
    L.prefix_in = pin.buf;
    L.keepalive = ka.buf;
    L.contrib = contrib;
    L.dtype = dtype;
    L.world = world;
    L.tmo = tmo;
    L.slice = slice;
    /* bounds: every frame lies in the buffer, every scratch receive fits the scratch */
    for (Py_ssize_t i = 0; i < L.nsends; i++) {
        const int64_t *g = L.sends + 4 * i;
        if (g[2] < 0 || g[3] < 0 || g[2] + g[3] > buf.len) {
            PyErr_SetString(PyExc_ValueError, "allreduce_lane: send frame outside the buffer");
            goto out;
        }
    }
    for (Py_ssize_t i = 0; i < L.nrecvs; i++) {
        const int64_t *f = L.recvs + 6 * i;
        Py_ssize_t need = f[3] <= ADD_PIECE ? (Py_ssize_t)f[3] : ADD_PIECE + (Py_ssize_t)rl_itemsize(dtype);
        if (f[2] < 0 || f[3] < 0 || f[2] + f[3] > buf.len || (f[4] && need > scratch.len) || f[5] >= L.nsends
            || (int64_t)(f[3] % rl_itemsize(dtype))) {
            PyErr_SetString(PyExc_ValueError, "allreduce_lane: receive frame outside the buffers");
            goto out;
        }
    }
    /* the queue holds every data frame at once at most, and one keepalive (queued only when empty) */
    L.qcap = L.nsends + 2;
    L.q = malloc(sizeof(Out) * (size_t)L.qcap);
    if (!L.q) {
        PyErr_NoMemory();
        goto out;
    }
    pthread_mutex_init(&L.mu, NULL);
    pthread_cond_init(&L.cv, NULL);
    L.ts = PyEval_SaveThread();
    int st = rl_run(&L);
    PyEval_RestoreThread(L.ts);
    PyObject *hdr = Py_None, *pending = Py_None;
    Py_INCREF(hdr);
    Py_INCREF(pending);
    if (st == ST_BAD_PREFIX || st == ST_BAD_SUFFIX) {
        Py_DECREF(hdr);
        hdr = PyBytes_FromStringAndSize((const char *)L.hdr, FRAME_LEN);
    } else if (st == ST_INTERRUPTED && L.exc != NULL) {  /* the exception rides in the header slot */
        Py_DECREF(hdr);
        hdr = L.exc;
        L.exc = NULL;
    }
    if (L.qlen && L.q[L.qhead].done) {  /* a frame half-written to the right */
        Out *o = &L.q[L.qhead];
        size_t hd = o->done < o->hlen ? o->done : o->hlen;
        size_t pd = o->done - hd;
        Py_DECREF(pending);
        pending = Py_BuildValue("(y#nn)", (const char *)o->hdr + hd, (Py_ssize_t)(o->hlen - hd),
                                (Py_ssize_t)(o->pay ? o->pay + pd - L.buf : 0), (Py_ssize_t)(o->plen - pd));
    }
    if (hdr && pending)
        result = Py_BuildValue("(iLi(LL)OO)", st, (long long)L.total, L.err, (long long)L.mismatch[0],
                               (long long)L.mismatch[1], hdr, pending);
    Py_XDECREF(hdr);
    Py_XDECREF(pending);
out:
    Py_XDECREF(L.exc);
    if (L.q) {
        pthread_cond_destroy(&L.cv);
        pthread_mutex_destroy(&L.mu);
    }
    free(L.q);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&sends);
    PyBuffer_Release(&recvs);
    PyBuffer_Release(&pout);
    PyBuffer_Release(&pin);
    PyBuffer_Release(&ka);
    return result;
}

static PyMethodDef methods[] = {
    {"allreduce_lane", allreduce_lane, METH_VARARGS,
     "Run one lane's allreduce schedule; returns (status, total, errno, detail, header, pending)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ringloop", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ringloop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "SCRATCH_BYTES", SCRATCH_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
