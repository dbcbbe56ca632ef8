/* The send side of the C ring loop: frames queued in order, written by a thread of their own
 * with blocking writes, or by the receiving thread itself while that thread is idle. */
#include "ringloop.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

static size_t iov_from(const Out *o, size_t done, struct iovec *iov) {
    int n = 0;
    if (done < o->hlen) {
        iov[n].iov_base = (void *)(o->hdr + done);
        iov[n].iov_len = o->hlen - done;
        n++;
        done = 0;
    } else {
        done -= o->hlen;
    }
    if (o->plen > done) {
        iov[n].iov_base = (void *)(o->pay + done);
        iov[n].iov_len = o->plen - done;
        n++;
    }
    return (size_t)n;
}

static ssize_t write_from(int fd, const Out *o, size_t done, int flags) {
    struct iovec iov[2];
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = iov_from(o, done, iov);
    return sendmsg(fd, &mh, flags | MSG_NOSIGNAL);
}

/* Queue a frame (the wire is "<" structs: little-endian hosts only, checked at import). While
 * the sender thread is idle, first write it here without blocking. */
void rl_push(Loop *L, const unsigned char *hdr, const char *pay, size_t plen) {
    Out o;
    memcpy(o.hdr, hdr, FRAME_LEN);
    o.hlen = FRAME_LEN;
    o.pay = pay;
    o.plen = plen;
    o.done = 0;
    o.queued = rl_now();
    pthread_mutex_lock(&L->mu);
    int idle = L->qlen == 0 && !L->busy && !L->exited;
    pthread_mutex_unlock(&L->mu);
    if (idle) {  /* nobody else writes while the queue is empty: only this thread fills it */
        ssize_t w = write_from(L->rfd, &o, 0, MSG_DONTWAIT);
        if (w > 0) {
            o.done = (size_t)w;
            pthread_mutex_lock(&L->mu);
            L->last_tx = rl_now();
            pthread_mutex_unlock(&L->mu);
            if (o.done == o.hlen + o.plen)
                return;
        }
        /* EAGAIN or an error: the sender thread retries and reports the error */
    }
    pthread_mutex_lock(&L->mu);
    L->q[(L->qhead + L->qlen) % L->qcap] = o;
    L->qlen++;
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
}

void rl_push_frame(Loop *L, Py_ssize_t si, uint32_t flags, uint32_t count) {
    const int64_t *g = L->sends + 4 * si;
    unsigned char h[FRAME_LEN];
    size_t plen = (flags & F_EMPTY) ? 0 : (size_t)g[3];
    memcpy(h, L->prefix_out, PREFIX_LEN);
    memset(h + PREFIX_LEN, 0, SUFFIX_LEN);
    put_u32(h + PREFIX_LEN, (uint32_t)g[0]);
    put_u32(h + PREFIX_LEN + 4, (uint32_t)g[1]);
    h[PREFIX_LEN + 8] = (unsigned char)flags;
    put_u32(h + PREFIX_LEN + 12, count);
    put_u64(h + PREFIX_LEN + 16, plen);
    rl_push(L, h, plen ? L->buf + g[2] : NULL, plen);
}

/* Whether the right neighbour ended our connection: the reverse direction only ever carries its
 * error frame or its EOF (or the kernel failed the socket). A neighbour that shut its side while
 * its receive window was closed may never open it again (it lingers in FIN-WAIT-2 and answers
 * window probes without a reset), so a blocked write must look instead of waiting for the op
 * timeout. Returns the errno to report, or 0 while the connection stands. */
int rl_right_ended(Loop *L) {
    struct pollfd p = {.fd = L->rfd, .events = POLLIN | POLLRDHUP, .revents = 0};
    if (poll(&p, 1, 0) != 1 || !p.revents)
        return 0;
    int e = 0;
    socklen_t n = sizeof e;
    if (getsockopt(L->rfd, SOL_SOCKET, SO_ERROR, &e, &n) < 0 || e == 0)
        e = EPIPE;
    return e;
}

/* The sender thread: writes queued frames in order with blocking writes (SO_SNDTIMEO slices,
 * set by module.c). It stops on close (queue empty), on stop (after the frame in flight or a
 * slice without progress), or on its own failure, which it reports by shutting the receive side
 * of the left socket so that the receiving thread, while it still receives, wakes up at once. */
void *rl_sender_main(void *arg) {
    Loop *L = arg;
    pthread_mutex_lock(&L->mu);
    for (;;) {
        while (!L->qlen && !L->closing && !L->stop)
            pthread_cond_wait(&L->cv, &L->mu);
        if (L->stop || !L->qlen)
            break;
        Out *o = &L->q[L->qhead];
        size_t done = o->done, total = o->hlen + o->plen;
        double since = L->last_tx > o->queued ? L->last_tx : o->queued;
        L->busy = 1;
        pthread_mutex_unlock(&L->mu);
        int st = ST_OK, e = 0, stopped = 0;
        while (done < total) {
            ssize_t w = write_from(L->rfd, o, done, 0);
            if (w > 0) {
                done += (size_t)w;
                since = rl_now();
                continue;
            }
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {  /* a slice without progress */
                if (rl_now() - since >= L->tmo) {
                    st = ST_SEND_TIMEOUT;
                    break;
                }
                if ((e = rl_right_ended(L)) != 0) {  /* it will never read on: fail now, not at tmo */
                    st = ST_SEND_ERROR;
                    break;
                }
                if (__atomic_load_n(&L->stop, __ATOMIC_ACQUIRE)) {
                    stopped = 1;
                    break;
                }
                continue;
            }
            st = ST_SEND_ERROR;
            e = w < 0 ? errno : EPIPE;
            break;
        }
        pthread_mutex_lock(&L->mu);
        L->busy = 0;
        o->done = done;
        L->last_tx = since;
        if (done == total) {
            L->qhead = (L->qhead + 1) % L->qcap;
            L->qlen--;
        }
        if (st != ST_OK) {
            L->sst = st;
            L->serr = e;
            break;
        }
        if (stopped)
            break;
    }
    L->exited = 1;
    if (L->sst != ST_OK && L->receiving)  /* under the lock: lfd is still the loop's socket */
        shutdown(L->lfd, SHUT_RD);
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
    return NULL;
}

/* The sender thread's failure, if it has one (it also woke us by shutting the left socket). */
int rl_sender_failed(Loop *L) {
    pthread_mutex_lock(&L->mu);
    int st = L->sst;
    L->err = L->serr;
    pthread_mutex_unlock(&L->mu);
    return st;
}

/* Tell the sender thread to stop (`stop`) or to finish the queue and stop (`closing`), and wait
 * for it. While the queue drains, every slice runs signal handlers and reads the communicator's
 * failure; either turns the drain into a stop. */
int rl_stop_sender(Loop *L, pthread_t th, int drain) {
    int st = ST_OK;
    pthread_mutex_lock(&L->mu);
    if (drain)
        L->closing = 1;
    else
        __atomic_store_n(&L->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&L->cv);
    while (!L->exited) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)(L->slice * 1e9);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&L->cv, &L->mu, &ts);
        if (!L->exited && drain && st == ST_OK) {
            pthread_mutex_unlock(&L->mu);
            st = rl_check_python(L);
            pthread_mutex_lock(&L->mu);
            if (st != ST_OK) {  /* interrupted while draining: stop instead */
                __atomic_store_n(&L->stop, 1, __ATOMIC_RELEASE);
                pthread_cond_broadcast(&L->cv);
            }
        }
    }
    pthread_mutex_unlock(&L->mu);
    pthread_join(th, NULL);
    return st;
}
