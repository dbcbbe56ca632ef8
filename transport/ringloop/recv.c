/* The receiving thread of the C ring loop: frames from the left, checked against the plan,
 * reduce-phase chunks added into the tensor, and the frame each one unlocks queued to the right. */
#include "ringloop.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

/* dst[i] += src[i]: IEEE additions for floats (as numpy's, so both loops give the same bits),
 * wrap-around for integers (unsigned arithmetic, as numpy). */
#define ADD_LOOP(T)                                                                  \
    do {                                                                             \
        T *d = (T *)dst;                                                             \
        const T *s = (const T *)src;                                                 \
        size_t n = nbytes / sizeof(T);                                               \
        for (size_t i = 0; i < n; i++) d[i] += s[i];                                 \
    } while (0)

/* Vectorised for AVX2 where the CPU has it (resolved once at load), plain SSE2 otherwise. */
__attribute__((target_clones("avx2", "default")))
static void add_into(int dtype, char *dst, const char *src, size_t nbytes) {
    switch (dtype) {
    case DT_F32: ADD_LOOP(float); break;
    case DT_F64: ADD_LOOP(double); break;
    case DT_I32: ADD_LOOP(uint32_t); break;
    case DT_I64: ADD_LOOP(uint64_t); break;
    }
}

static void start_header(Loop *L) {
    L->in_hdr = 1;
    L->to_scratch = 0;
    L->dst = (char *)L->hdr;
    L->want = FRAME_LEN;
    L->got = 0;
}

/* A whole frame of recvs[ri] has arrived (header and payload): finish it as receiver.py does. */
static int finish_frame(Loop *L) {
    const int64_t *f = L->recvs + 6 * L->ri;
    int64_t off = f[2], n = f[3], reduce = f[4], nxt = f[5];
    uint32_t count = L->count;
    int out_empty;
    if (reduce) {
        out_empty = L->empty ? !L->contrib : 0;
        count += L->contrib ? 1 : 0;
        if (nxt < 0 || L->sends[4 * nxt] == L->world - 1) {
            if (out_empty && n)
                memset(L->buf + off, 0, (size_t)n);
            if (L->total < 0)
                L->total = count;
        }
    } else {
        if (L->empty) {
            if (n)
                memset(L->buf + off, 0, (size_t)n);
            out_empty = 1;
        } else {
            out_empty = 0;
        }
        if (L->total >= 0 && (int64_t)count != L->total) {
            L->mismatch[0] = count;
            L->mismatch[1] = L->total;
            return ST_COUNT_MISMATCH;
        }
        if (L->total < 0)
            L->total = count;
    }
    if (nxt >= 0)
        rl_push_frame(L, nxt, out_empty ? F_EMPTY : 0, count);
    L->ri++;
    start_header(L);
    return ST_OK;
}

/* A header has arrived: check it and set up the payload receive. */
static int got_header(Loop *L) {
    const unsigned char *h = L->hdr;
    if (memcmp(h, L->prefix_in, PREFIX_LEN) != 0) {
        /* a keepalive from the left: magic, op, and (epoch, shard, rank) as expected, no payload */
        if (memcmp(h, L->prefix_in, 4) == 0 && h[4] == OP_KEEPALIVE &&
            memcmp(h + 8, L->prefix_in + 8, 16) == 0 && get_u64(h + PREFIX_LEN + 16) == 0) {
            start_header(L);
            return ST_OK;
        }
        return ST_BAD_PREFIX;
    }
    const int64_t *f = L->recvs + 6 * L->ri;
    uint32_t st = get_u32(h + PREFIX_LEN), ch = get_u32(h + PREFIX_LEN + 4);
    unsigned flags = h[PREFIX_LEN + 8];
    uint64_t plen = get_u64(h + PREFIX_LEN + 16);
    int empty = (flags & F_EMPTY) != 0;
    if (st != (uint32_t)f[0] || ch != (uint32_t)f[1] || plen != (empty ? 0 : (uint64_t)f[3])) {
        L->mismatch[0] = L->ri;  /* which receive of the plan it was */
        return ST_BAD_SUFFIX;
    }
    L->count = get_u32(h + PREFIX_LEN + 12);
    L->empty = empty;
    L->in_hdr = 0;
    L->got = 0;
    L->added = 0;
    L->to_scratch = 0;
    if (empty || f[3] == 0)
        return finish_frame(L);
    L->want = (size_t)f[3];
    if (f[4] && L->contrib) {
        L->to_scratch = 1;
        L->dst = L->scratch;
    } else {
        L->dst = L->buf + f[2];
    }
    return ST_OK;
}

/* k new bytes arrived at L->dst + L->got. */
static int received(Loop *L, size_t k) {
    L->got += k;
    if (L->in_hdr)
        return L->got == L->want ? got_header(L) : ST_OK;
    if (L->to_scratch) {  /* the scratch holds bytes [added, got) of the chunk */
        size_t held = L->got - L->added;
        size_t whole = held - held % rl_itemsize(L->dtype);
        if (whole) {
            const int64_t *f = L->recvs + 6 * L->ri;
            add_into(L->dtype, L->buf + f[2] + L->added, L->scratch, whole);
            memmove(L->scratch, L->scratch + whole, held - whole);  /* a split element, if any */
            L->added += whole;
        }
    }
    return L->got == L->want ? finish_frame(L) : ST_OK;
}

/* Whether the right neighbour's host acknowledged nothing for L->ack seconds while our data
 * waits and the kernel already retransmitted it (wire.unacknowledged says why not a
 * TCP_USER_TIMEOUT). The op's first send is at least L->ack old, so an old last ACK from before
 * the op does not count. */
static int right_silent(Loop *L, double t) {
    if (!(L->ack > 0) || t - L->t0 < L->ack)
        return 0;
    struct tcp_info ti;
    socklen_t n = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(L->rfd, IPPROTO_TCP, TCP_INFO, &ti, &n) < 0)
        return 0;
    return ti.tcpi_retransmits > 0 && ti.tcpi_unacked > 0 && ti.tcpi_last_ack_recv >= (uint32_t)(L->ack * 1000);
}

/* Idle bookkeeping while starved on the left: a timeout, the right neighbour gone, or a
 * keepalive to the right. */
static int starved(Loop *L, double t) {
    double idle = t - L->last_rx;
    if (idle >= L->tmo)
        return ST_RECV_TIMEOUT;
    /* The connection to the right ended while nothing was being written to it: the right
     * neighbour sent back what it only ever sends, its error frame or EOF, or the kernel failed
     * it. Waiting on the left would only end at the op timeout; Python blames from the frame,
     * if any, else the right neighbour (sender.write_failed). */
    int e = rl_right_ended(L);
    if (e != 0) {
        L->err = e;
        return ST_SEND_ERROR;
    }
    if (right_silent(L, t))
        return ST_RIGHT_SILENT;
    if (idle >= L->ka_at) {
        L->ka_at = idle + L->tmo / 4;
        pthread_mutex_lock(&L->mu);
        int quiet = L->qlen == 0 && !L->busy;
        pthread_mutex_unlock(&L->mu);
        if (quiet)
            rl_push(L, L->keepalive, NULL, 0);
    }
    return ST_OK;
}

static int receive_all(Loop *L) {
    while (L->ri < L->nrecvs) {
        size_t ask = L->want - L->got;
        char *at = L->dst + L->got;
        if (L->to_scratch) {  /* pieces into the start of the scratch, added while in the cache */
            if (ask > ADD_PIECE)
                ask = ADD_PIECE;
            at = L->scratch + (L->got - L->added);
        }
        ssize_t k = recv(L->lfd, at, ask, MSG_WAITALL);
        if (k > 0) {
            L->last_rx = rl_now();
            L->ka_at = L->tmo / 4;
            int st = received(L, (size_t)k);
            if (st != ST_OK)
                return st;
            continue;
        }
        if (k == 0) {
            int st = rl_sender_failed(L);
            return st != ST_OK ? st : ST_EOF;
        }
        int e = errno;
        if (e == EINTR) {
            int st = rl_check_python(L);
            if (st != ST_OK)
                return st;
            continue;
        }
        if (e != EAGAIN && e != EWOULDBLOCK) {
            int st = rl_sender_failed(L);
            if (st != ST_OK)
                return st;
            L->err = e;
            return ST_RECV_ERROR;
        }
        /* one SO_RCVTIMEO slice without data */
        int st = rl_check_python(L);
        if (st == ST_OK)
            st = rl_sender_failed(L);
        if (st == ST_OK)
            st = starved(L, rl_now());
        if (st != ST_OK)
            return st;
    }
    return ST_OK;
}

int rl_run(Loop *L) {
    L->total = -1;
    L->t0 = rl_now();
    L->last_rx = L->t0;
    L->ka_at = L->tmo / 4;
    start_header(L);
    /* the sender thread takes no signals: they go to Python's handlers via the calling thread */
    sigset_t all, old;
    sigfillset(&all);
    pthread_t th;
    L->receiving = 1;
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&th, NULL, rl_sender_main, L);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {  /* a local failure: no neighbour is to blame */
        L->err = rc;
        return ST_NO_THREAD;
    }
    for (Py_ssize_t i = 0; i < L->first_sends; i++) {
        if (L->contrib)
            rl_push_frame(L, i, 0, 1);
        else
            rl_push_frame(L, i, F_EMPTY, 0);
    }
    int st = receive_all(L);
    pthread_mutex_lock(&L->mu);
    L->receiving = 0;  /* from here on nobody reads lfd, and Python may close it after a failure */
    pthread_mutex_unlock(&L->mu);
    if (st != ST_OK) {
        rl_stop_sender(L, th, 0);
        return st;
    }
    st = rl_stop_sender(L, th, 1);
    if (st != ST_OK)
        return st;
    return rl_sender_failed(L);
}
