/* Shared by the C ring loop's files: the wire constants, statuses and the loop's state.
 * module.c: the Python entry point; recv.c: the receiving thread; send.c: the send queue and
 * its thread. See module.c for what the loop is and why it exists. */
#ifndef P2PFT_RINGLOOP_H
#define P2PFT_RINGLOOP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define PREFIX_LEN 48
#define SUFFIX_LEN 24
#define FRAME_LEN (PREFIX_LEN + SUFFIX_LEN)
#define OP_KEEPALIVE 4
#define F_EMPTY 1
/* Reduce-phase chunks are received and added in pieces of this size, so the scratch they pass
 * through stays in the L1/L2 cache; the scratch needs SCRATCH_BYTES (a piece and a split element). */
#define ADD_PIECE (64 * 1024)
#define SCRATCH_BYTES (ADD_PIECE + 8)

/* Statuses; transport/native.py holds the same numbers. */
enum {
    ST_OK = 0,
    ST_RECV_TIMEOUT = 1,
    ST_SEND_TIMEOUT = 2,
    ST_EOF = 3,
    ST_RECV_ERROR = 4,
    ST_SEND_ERROR = 5,
    ST_BAD_PREFIX = 6,
    ST_BAD_SUFFIX = 7,
    ST_COUNT_MISMATCH = 8,
    ST_INTERRUPTED = 9,   /* a Python signal handler raised (Ctrl-C): the exception is handed back */
    ST_FAILED = 10,       /* the communicator failed elsewhere (another lane, abort) */
    ST_NO_THREAD = 11,    /* the sender thread could not be started (err: its errno) */
    ST_RIGHT_SILENT = 12, /* the right neighbour's host acknowledged nothing for `ack` seconds */
};

/* dtype codes of transport/buffers.py that this loop adds; others stay on the Python loop. */
enum { DT_F32 = 3, DT_F64 = 4, DT_I32 = 8, DT_I64 = 9 };

typedef struct {
    unsigned char hdr[FRAME_LEN];
    size_t hlen;          /* FRAME_LEN */
    const char *pay;
    size_t plen;
    size_t done;          /* bytes of hdr + payload written */
    double queued;        /* when it was queued: the no-progress clock starts no earlier */
} Out;

typedef struct {
    /* inputs */
    int lfd, rfd;
    char *buf;
    char *scratch;
    const int64_t *sends;   /* 4 per frame: step, chunk, off, nbytes */
    Py_ssize_t nsends, first_sends;
    const int64_t *recvs;   /* 6 per frame: step, chunk, off, nbytes, reduce, next send */
    Py_ssize_t nrecvs;
    const unsigned char *prefix_out, *prefix_in, *keepalive;
    int contrib, dtype, world;
    double tmo, slice;
    double ack, t0;       /* the ack timeout (0: off) and when this op began */
    /* send queue (ring buffer), shared with the sender thread under `mu` */
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* a frame queued, close or stop asked, the sender exited */
    Out *q;
    Py_ssize_t qcap, qhead, qlen;
    int busy;             /* the sender thread is writing the head frame (outside the lock) */
    int closing, stop, exited;
    int receiving;        /* the receive loop runs: a failing sender wakes it by shutting lfd */
    int sst, serr;        /* how the sender thread failed */
    double last_tx;       /* time of the last byte written to the right */
    /* receive state */
    Py_ssize_t ri;
    int in_hdr;
    unsigned char hdr[FRAME_LEN];
    size_t got, want, added;
    char *dst;
    int to_scratch, empty;
    uint32_t count;
    int64_t total;
    double last_rx, ka_at;
    /* outputs */
    int err;
    int64_t mismatch[2];
    /* the thread state while the GIL is released, and an exception a signal handler raised */
    PyThreadState *ts;
    PyObject *exc;
    PyObject *fstate;     /* the communicator's failure state: its `failed` is set on a failure */
} Loop;

static inline double rl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t get_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline size_t rl_itemsize(int dtype) { return (dtype == DT_F32 || dtype == DT_I32) ? 4 : 8; }

/* send.c */
void rl_push(Loop *L, const unsigned char *hdr, const char *pay, size_t plen);
void rl_push_frame(Loop *L, Py_ssize_t si, uint32_t flags, uint32_t count);
void *rl_sender_main(void *arg);
int rl_sender_failed(Loop *L);
int rl_stop_sender(Loop *L, pthread_t th, int drain);
int rl_right_ended(Loop *L);
/* recv.c */
int rl_run(Loop *L);
/* module.c */
int rl_check_python(Loop *L);

#endif
