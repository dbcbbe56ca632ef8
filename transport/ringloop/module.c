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
#include <sys/socket.h>
#include <sys/time.h>

/* Between system calls, with the GIL for a moment, as the Python loop does: run pending signal
 * handlers (main thread only; a no-op elsewhere), so Ctrl-C or a SIGTERM handler is not held up
 * for a timeout, and read whether the communicator failed elsewhere (another lane, abort): a
 * lane that has received everything no longer reads the socket that such a failure shuts. */
int rl_check_python(Loop *L) {
    PyEval_RestoreThread(L->ts);
    int st = ST_OK;
    if (PyErr_CheckSignals() < 0) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        if (tb != NULL && v != NULL)
            PyException_SetTraceback(v, tb);
        Py_XDECREF(t);
        Py_XDECREF(tb);
        L->exc = v;
        st = ST_INTERRUPTED;
    } else if (L->fstate != Py_None) {
        PyObject *failed = PyObject_GetAttrString(L->fstate, "failed");
        if (failed == NULL)
            PyErr_Clear();  /* checked at entry: cannot happen short of a deleted attribute */
        else if (failed != Py_None)
            st = ST_FAILED;
        Py_XDECREF(failed);
    }
    L->ts = PyEval_SaveThread();
    return st;
}

/* Socket slices set here, not trusted to the caller: every blocking read and write of the loop
 * returns within one, so each of its waits sees its timeout, a stop and signal handlers. */
static int set_slices(int lfd, int rfd, double slice) {
    struct timeval tv;
    tv.tv_sec = (time_t)slice;
    tv.tv_usec = (suseconds_t)((slice - (double)tv.tv_sec) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0)
        tv.tv_usec = 1000;  /* zero would mean "no timeout" */
    if (setsockopt(lfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0
        || setsockopt(rfd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* Every send index is queued at most once (the queue holds them all at most): the first sends,
 * then those the receives unlock, each after the first sends. 1: valid, 0: not, -1: no memory. */
static int plan_is_valid(const Loop *L) {
    if (L->first_sends < 0 || L->first_sends > L->nsends)
        return 0;
    unsigned char *seen = calloc((size_t)L->nsends + 1, 1);
    if (seen == NULL)
        return -1;
    int ok = 1;
    for (Py_ssize_t i = 0; i < L->nrecvs && ok; i++) {
        int64_t nxt = L->recvs[6 * i + 5];
        if (nxt < 0)
            continue;
        if (nxt < L->first_sends || nxt >= L->nsends || seen[nxt])
            ok = 0;
        else
            seen[nxt] = 1;
    }
    free(seen);
    return ok;
}

static PyObject *allreduce_lane(PyObject *self, PyObject *args) {
    int lfd, rfd, contrib, dtype, world;
    Py_buffer buf, scratch, sends, recvs, pout, pin, ka;
    Py_ssize_t first_sends;
    double tmo, slice, ack = 0.0;
    PyObject *fstate;
    if (!PyArg_ParseTuple(args, "iiw*w*y*ny*y*y*y*piiddO|d", &lfd, &rfd, &buf, &scratch, &sends, &first_sends,
                          &recvs, &pout, &pin, &ka, &contrib, &dtype, &world, &tmo, &slice, &fstate, &ack))
        return NULL;
    PyObject *result = NULL;
    Loop L;
    memset(&L, 0, sizeof L);
    if (pout.len != PREFIX_LEN || pin.len != PREFIX_LEN || ka.len != FRAME_LEN || sends.len % 32 || recvs.len % 48
        || (dtype != DT_F32 && dtype != DT_F64 && dtype != DT_I32 && dtype != DT_I64) || !(slice > 0)
        || (fstate != Py_None && !PyObject_HasAttrString(fstate, "failed"))) {
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
    L.ack = ack > 0 ? ack : 0.0;
    L.fstate = fstate;
    /* bounds: every frame lies in the buffer, every scratch receive fits the scratch */
    for (Py_ssize_t i = 0; i < L.nsends; i++) {
        const int64_t *g = L.sends + 4 * i;
        if (g[2] < 0 || g[3] < 0 || g[2] > buf.len || g[3] > buf.len - g[2]) {
            PyErr_SetString(PyExc_ValueError, "allreduce_lane: send frame outside the buffer");
            goto out;
        }
    }
    for (Py_ssize_t i = 0; i < L.nrecvs; i++) {
        const int64_t *f = L.recvs + 6 * i;
        Py_ssize_t need = f[3] <= ADD_PIECE ? (Py_ssize_t)f[3] : ADD_PIECE + (Py_ssize_t)rl_itemsize(dtype);
        if (f[2] < 0 || f[3] < 0 || f[2] > buf.len || f[3] > buf.len - f[2] || (f[4] && need > scratch.len)
            || (int64_t)(f[3] % rl_itemsize(dtype))) {
            PyErr_SetString(PyExc_ValueError, "allreduce_lane: receive frame outside the buffers");
            goto out;
        }
    }
    int valid = plan_is_valid(&L);
    if (valid <= 0) {
        if (valid < 0)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_ValueError, "allreduce_lane: a send is queued twice or is not there");
        goto out;
    }
    if (set_slices(lfd, rfd, slice) < 0)
        goto out;
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
    if (m != NULL && (PyModule_AddIntConstant(m, "SCRATCH_BYTES", SCRATCH_BYTES) < 0
                      || PyModule_AddIntConstant(m, "WATCHES_RIGHT", 1) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
