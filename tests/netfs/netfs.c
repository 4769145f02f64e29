/*
 * netfs: a fault-injecting passthrough filesystem that stands in for one node's
 * mount of a network filesystem (NFS, Lustre, GPFS) in kernelcache's tests.
 *
 *     netfs BACKING MOUNTPOINT CONTROL BUSY FLOCK_MODE
 *
 * Two instances over one BACKING directory are two "nodes". Files are tracked
 * by inode (an O_PATH descriptor per inode, as libfuse's passthrough_ll does):
 * a name replaced by the other mount is a new inode here, as on an NFS client,
 * where a path-based passthrough would keep the old identity.
 *
 * CONTROL is a small shared file (layout in tests/netfs.py): the fault settings,
 * read on every request, and the counters of requests and injected faults.
 * BUSY is a table of open counts by inode hash, shared by both mounts, so that
 * "EBUSY on rename or unlink of an open file" sees the other node's opens.
 * FLOCK_MODE: "local" leaves flock to the kernel (local to this mount: it never
 * conflicts with the other mount, FUSE's behaviour for a filesystem without lock
 * operations); "none" fails every flock with ENOLCK (Lustre without -o flock);
 * "shared" takes the flock on the backing file (locks that span the nodes).
 */
#define FUSE_USE_VERSION 312 /* 3.12: fuse_session_loop_mt with the opaque loop config */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

/* Request kinds: the counters' order (tests/netfs.py OPS) and the bits of the fault masks. */
enum { OP_LOOKUP, OP_GETATTR, OP_SETATTR, OP_READLINK, OP_MKDIR, OP_UNLINK, OP_RMDIR, OP_SYMLINK,
       OP_RENAME, OP_LINK, OP_OPEN, OP_READ, OP_WRITE, OP_FLUSH, OP_RELEASE, OP_FSYNC, OP_OPENDIR,
       OP_READDIR, OP_RELEASEDIR, OP_STATFS, OP_CREATE, OP_FLOCK, OP_FORGET, OP_MKNOD, OP_COUNT };

/* The shared control block; must match tests/netfs.py. */
struct control {
    uint64_t magic;
    int32_t latency_us;       /* sleep before answering each request */
    int32_t stale_unlinked;   /* ESTALE for an inode removed by the other mount (NFSv3) */
    int32_t ebusy_open;       /* EBUSY on rename/unlink/rmdir of an open file or directory */
    int32_t attr_timeout_ms;  /* how long the kernel may trust attributes and names */
    int32_t estale_ppm, eio_ppm, ebusy_ppm, pad;  /* random faults, per million requests */
    uint64_t estale_mask, eio_mask, ebusy_mask;   /* which request kinds get them */
    uint64_t reserved[4];
    _Atomic uint64_t ops[32];         /* requests answered, per kind */
    _Atomic uint64_t injected[4];     /* ESTALE (random), ESTALE (unlinked), EIO, EBUSY */
};
#define MAGIC 0x3173666574656eULL  /* "netfs1" */
#define BUSY_SLOTS (1u << 20)

struct inode {
    int fd;                /* O_PATH descriptor of the backing inode */
    dev_t dev;
    ino_t ino;
    uint64_t refs;         /* lookups the kernel has not forgotten */
    int removed_here;      /* this mount unlinked or replaced it: its own opens stay valid */
    struct inode *next;
};

static struct control *ctl;
static _Atomic uint32_t *busy;
static struct inode root;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct inode *table[4096];
static int flock_mode; /* 0 local, 1 none, 2 shared */
static _Thread_local uint64_t rng;

static struct inode *I(fuse_ino_t n) { return n == FUSE_ROOT_ID ? &root : (struct inode *)(uintptr_t)n; }
static uint32_t slot(ino_t ino) { return (uint32_t)((ino * 0x9E3779B97F4A7C15ULL) >> 44) % BUSY_SLOTS; }

static uint32_t next_random(void) {
    if (!rng) rng = (uint64_t)pthread_self() ^ (uint64_t)time(NULL) ^ 0x9E3779B97F4A7C15ULL;
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static int chance(int32_t ppm, uint64_t mask, int op) {
    return ppm > 0 && (mask >> op & 1) && (int32_t)(next_random() % 1000000) < ppm;
}

/* Every request starts here: count it, wait out the latency, maybe fail it. */
static int enter(int op) {
    atomic_fetch_add(&ctl->ops[op], 1);
    int32_t us = ctl->latency_us;
    if (us > 0) {
        struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    if (chance(ctl->estale_ppm, ctl->estale_mask, op)) { atomic_fetch_add(&ctl->injected[0], 1); return ESTALE; }
    if (chance(ctl->eio_ppm, ctl->eio_mask, op)) { atomic_fetch_add(&ctl->injected[2], 1); return EIO; }
    if (chance(ctl->ebusy_ppm, ctl->ebusy_mask, op)) { atomic_fetch_add(&ctl->injected[3], 1); return EBUSY; }
    return 0;
}

/* An inode that the other mount removed is gone for this one, as on an NFSv3 client. */
static int stale(struct inode *in) {
    struct stat st;
    if (!ctl->stale_unlinked || in == &root || in->removed_here) return 0;
    if (fstat(in->fd, &st) == 0 && st.st_nlink > 0) return 0;
    atomic_fetch_add(&ctl->injected[1], 1);
    return ESTALE;
}

static double timeout(void) { return ctl->attr_timeout_ms / 1000.0; }

static struct inode *find(dev_t dev, ino_t ino) {
    for (struct inode *p = table[ino % 4096]; p; p = p->next)
        if (p->ino == ino && p->dev == dev) return p;
    return NULL;
}

/* Look ``name`` up under ``parent`` and fill ``e``; one more kernel reference on success. */
static int do_lookup(fuse_ino_t parent, const char *name, struct fuse_entry_param *e) {
    memset(e, 0, sizeof(*e));
    e->attr_timeout = e->entry_timeout = timeout();
    int fd = openat(I(parent)->fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno;
    if (fstatat(fd, "", &e->attr, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0) {
        int err = errno; close(fd); return err;
    }
    pthread_mutex_lock(&table_lock);
    struct inode *in = find(e->attr.st_dev, e->attr.st_ino);
    if (in) {
        close(fd);
    } else {
        in = calloc(1, sizeof(*in));
        if (!in) { pthread_mutex_unlock(&table_lock); close(fd); return ENOMEM; }
        in->fd = fd; in->dev = e->attr.st_dev; in->ino = e->attr.st_ino;
        in->next = table[in->ino % 4096]; table[in->ino % 4096] = in;
    }
    in->refs++;
    pthread_mutex_unlock(&table_lock);
    e->ino = (uintptr_t)in;
    return 0;
}

static void forget_one(fuse_ino_t n, uint64_t count) {
    struct inode *in = I(n);
    if (in == &root) return;
    pthread_mutex_lock(&table_lock);
    in->refs -= count;
    if (in->refs == 0) {
        struct inode **p = &table[in->ino % 4096];
        while (*p != in) p = &(*p)->next;
        *p = in->next;
        close(in->fd);
        free(in);
    }
    pthread_mutex_unlock(&table_lock);
}

static void reply_entry(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct fuse_entry_param e;
    int err = do_lookup(parent, name, &e);
    if (err) fuse_reply_err(req, err); else fuse_reply_entry(req, &e);
}

#define ENTER(op) do { int err_ = enter(op); if (err_) { fuse_reply_err(req, err_); return; } } while (0)
#define STALE(n) do { int err_ = stale(I(n)); if (err_) { fuse_reply_err(req, err_); return; } } while (0)

static void nf_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    /* libfuse asks for flock requests whenever the op exists; "local" leaves them to the kernel. */
    if (flock_mode == 0) conn->want &= ~(unsigned)FUSE_CAP_FLOCK_LOCKS;
    else if (conn->capable & FUSE_CAP_FLOCK_LOCKS) conn->want |= FUSE_CAP_FLOCK_LOCKS;
    conn->want &= ~(unsigned)FUSE_CAP_POSIX_LOCKS;
    conn->want &= ~(unsigned)FUSE_CAP_WRITEBACK_CACHE;
}

static void nf_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    ENTER(OP_LOOKUP); STALE(parent);
    struct fuse_entry_param e;
    int err = do_lookup(parent, name, &e);
    if (err == ENOENT && timeout() > 0) {  /* a cached "no such file", as NFS clients keep */
        e.ino = 0; e.entry_timeout = timeout();
        fuse_reply_entry(req, &e);
    } else if (err) {
        fuse_reply_err(req, err);
    } else {
        fuse_reply_entry(req, &e);
    }
}

static void nf_forget(fuse_req_t req, fuse_ino_t n, uint64_t nlookup) {
    atomic_fetch_add(&ctl->ops[OP_FORGET], 1);
    forget_one(n, nlookup);
    fuse_reply_none(req);
}

static void nf_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *f) {
    atomic_fetch_add(&ctl->ops[OP_FORGET], 1);
    for (size_t i = 0; i < count; i++) forget_one(f[i].ino, f[i].nlookup);
    fuse_reply_none(req);
}

static void nf_getattr(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi) {
    (void)fi;
    ENTER(OP_GETATTR); STALE(n);
    struct stat st;
    if (fstatat(I(n)->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0) fuse_reply_err(req, errno);
    else fuse_reply_attr(req, &st, timeout());
}

static void proc_path(char *buf, int fd) { snprintf(buf, 64, "/proc/self/fd/%d", fd); }

static void nf_setattr(fuse_req_t req, fuse_ino_t n, struct stat *a, int set, struct fuse_file_info *fi) {
    ENTER(OP_SETATTR); STALE(n);
    struct inode *in = I(n);
    char p[64]; proc_path(p, in->fd);
    int rc = 0;
    if (set & FUSE_SET_ATTR_MODE) rc = fi ? fchmod((int)fi->fh, a->st_mode) : chmod(p, a->st_mode);
    if (!rc && (set & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))) {
        uid_t u = (set & FUSE_SET_ATTR_UID) ? a->st_uid : (uid_t)-1;
        gid_t g = (set & FUSE_SET_ATTR_GID) ? a->st_gid : (gid_t)-1;
        rc = fchownat(in->fd, "", u, g, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW);
    }
    if (!rc && (set & FUSE_SET_ATTR_SIZE)) rc = fi ? ftruncate((int)fi->fh, a->st_size) : truncate(p, a->st_size);
    if (!rc && (set & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME))) {
        struct timespec tv[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
        if (set & FUSE_SET_ATTR_ATIME_NOW) tv[0].tv_nsec = UTIME_NOW;
        else if (set & FUSE_SET_ATTR_ATIME) tv[0] = a->st_atim;
        if (set & FUSE_SET_ATTR_MTIME_NOW) tv[1].tv_nsec = UTIME_NOW;
        else if (set & FUSE_SET_ATTR_MTIME) tv[1] = a->st_mtim;
        rc = fi ? futimens((int)fi->fh, tv) : utimensat(AT_FDCWD, p, tv, 0);
    }
    if (rc) { fuse_reply_err(req, errno); return; }
    struct stat st;
    if (fstatat(in->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0) fuse_reply_err(req, errno);
    else fuse_reply_attr(req, &st, timeout());
}

static void nf_readlink(fuse_req_t req, fuse_ino_t n) {
    ENTER(OP_READLINK); STALE(n);
    char buf[PATH_MAX + 1];
    ssize_t len = readlinkat(I(n)->fd, "", buf, sizeof(buf) - 1);
    if (len < 0) { fuse_reply_err(req, errno); return; }
    buf[len] = 0;
    fuse_reply_readlink(req, buf);
}

static void nf_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode) {
    ENTER(OP_MKDIR); STALE(parent);
    if (mkdirat(I(parent)->fd, name, mode) < 0) fuse_reply_err(req, errno);
    else reply_entry(req, parent, name);
}

static void nf_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, dev_t rdev) {
    ENTER(OP_MKNOD); STALE(parent);
    if (mknodat(I(parent)->fd, name, mode, rdev) < 0) fuse_reply_err(req, errno);
    else reply_entry(req, parent, name);
}

static void nf_symlink(fuse_req_t req, const char *target, fuse_ino_t parent, const char *name) {
    ENTER(OP_SYMLINK); STALE(parent);
    if (symlinkat(target, I(parent)->fd, name) < 0) fuse_reply_err(req, errno);
    else reply_entry(req, parent, name);
}

static void nf_link(fuse_req_t req, fuse_ino_t n, fuse_ino_t parent, const char *name) {
    ENTER(OP_LINK); STALE(n); STALE(parent);
    char p[64]; proc_path(p, I(n)->fd);
    if (linkat(AT_FDCWD, p, I(parent)->fd, name, AT_SYMLINK_FOLLOW) < 0) fuse_reply_err(req, errno);
    else reply_entry(req, parent, name);
}

/* The inode that ``name`` names now, if this mount knows it (for removed_here and EBUSY). */
static struct inode *known(fuse_ino_t parent, const char *name, struct stat *st) {
    if (fstatat(I(parent)->fd, name, st, AT_SYMLINK_NOFOLLOW) < 0) return NULL;
    pthread_mutex_lock(&table_lock);
    struct inode *in = find(st->st_dev, st->st_ino);
    pthread_mutex_unlock(&table_lock);
    return in;
}

static int is_busy(fuse_ino_t parent, const char *name) {
    struct stat st;
    if (!ctl->ebusy_open || fstatat(I(parent)->fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) return 0;
    if (atomic_load(&busy[slot(st.st_ino)]) == 0) return 0;
    atomic_fetch_add(&ctl->injected[3], 1);
    return 1;
}

static void remove_entry(fuse_req_t req, fuse_ino_t parent, const char *name, int flags, int op) {
    ENTER(op); STALE(parent);
    if (is_busy(parent, name)) { fuse_reply_err(req, EBUSY); return; }
    struct stat st;
    struct inode *in = known(parent, name, &st);
    if (unlinkat(I(parent)->fd, name, flags) < 0) { fuse_reply_err(req, errno); return; }
    if (in) in->removed_here = 1;
    fuse_reply_err(req, 0);
}

static void nf_unlink(fuse_req_t req, fuse_ino_t parent, const char *name) {
    remove_entry(req, parent, name, 0, OP_UNLINK);
}

static void nf_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name) {
    remove_entry(req, parent, name, AT_REMOVEDIR, OP_RMDIR);
}

static void nf_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags) {
    ENTER(OP_RENAME); STALE(parent); STALE(newparent);
    if (is_busy(parent, name) || is_busy(newparent, newname)) { fuse_reply_err(req, EBUSY); return; }
    struct stat st;
    struct inode *target = known(newparent, newname, &st);
    if (renameat2(I(parent)->fd, name, I(newparent)->fd, newname, flags) < 0) {
        fuse_reply_err(req, errno); return;
    }
    if (target && !(flags & RENAME_EXCHANGE)) target->removed_here = 1;
    fuse_reply_err(req, 0);
}

static void opened(int fd, int delta) {
    struct stat st;
    if (fstat(fd, &st) == 0) atomic_fetch_add(&busy[slot(st.st_ino)], (uint32_t)delta);
}

static void nf_open(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi) {
    ENTER(OP_OPEN); STALE(n);
    char p[64]; proc_path(p, I(n)->fd);
    int fd = open(p, (fi->flags & ~O_NOFOLLOW) | O_CLOEXEC);
    if (fd < 0) { fuse_reply_err(req, errno); return; }
    opened(fd, 1);
    fi->fh = (uint64_t)fd;
    fuse_reply_open(req, fi);
}

static void nf_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi) {
    ENTER(OP_CREATE); STALE(parent);
    int fd = openat(I(parent)->fd, name, (fi->flags | O_CREAT) & ~O_NOFOLLOW, mode);
    if (fd < 0) { fuse_reply_err(req, errno); return; }
    struct fuse_entry_param e;
    int err = do_lookup(parent, name, &e);
    if (err) { close(fd); fuse_reply_err(req, err); return; }
    opened(fd, 1);
    fi->fh = (uint64_t)fd;
    fuse_reply_create(req, &e, fi);
}

static void nf_read(fuse_req_t req, fuse_ino_t n, size_t size, off_t off, struct fuse_file_info *fi) {
    ENTER(OP_READ); STALE(n);
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    buf.buf[0].fd = (int)fi->fh;
    buf.buf[0].pos = off;
    fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

static void nf_write(fuse_req_t req, fuse_ino_t n, const char *data, size_t size, off_t off,
                     struct fuse_file_info *fi) {
    ENTER(OP_WRITE); STALE(n);
    ssize_t w = pwrite((int)fi->fh, data, size, off);
    if (w < 0) fuse_reply_err(req, errno); else fuse_reply_write(req, (size_t)w);
}

static void nf_flush(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi) {
    (void)n;
    atomic_fetch_add(&ctl->ops[OP_FLUSH], 1);
    /* Closing a dup releases POSIX locks held through this descriptor on the backing file. */
    int fd = dup((int)fi->fh);
    fuse_reply_err(req, fd < 0 ? errno : (close(fd) ? errno : 0));
}

static void nf_release(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi) {
    (void)n;
    atomic_fetch_add(&ctl->ops[OP_RELEASE], 1);
    opened((int)fi->fh, -1);
    close((int)fi->fh);
    fuse_reply_err(req, 0);
}

static void nf_fsync(fuse_req_t req, fuse_ino_t n, int datasync, struct fuse_file_info *fi) {
    ENTER(OP_FSYNC); STALE(n);
    int rc = datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh);
    fuse_reply_err(req, rc ? errno : 0);
}

struct dir { DIR *dp; off_t offset; struct dirent *entry; int fd; };

static void nf_opendir(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi) {
    ENTER(OP_OPENDIR); STALE(n);
    struct dir *d = calloc(1, sizeof(*d));
    int fd = d ? openat(I(n)->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    if (fd < 0) { int err = d ? errno : ENOMEM; free(d); fuse_reply_err(req, err); return; }
    d->dp = fdopendir(fd);
    if (!d->dp) { int err = errno; close(fd); free(d); fuse_reply_err(req, err); return; }
    d->fd = fd;
    opened(fd, 1);
    fi->fh = (uintptr_t)d;
    fuse_reply_open(req, fi);
}

static void nf_readdir(fuse_req_t req, fuse_ino_t n, size_t size, off_t off, struct fuse_file_info *fi) {
    ENTER(OP_READDIR); STALE(n);
    struct dir *d = (struct dir *)(uintptr_t)fi->fh;
    char *buf = calloc(1, size), *p = buf;
    size_t rem = size;
    if (!buf) { fuse_reply_err(req, ENOMEM); return; }
    if (off != d->offset) { seekdir(d->dp, off); d->entry = NULL; d->offset = off; }
    for (;;) {
        if (!d->entry) {
            errno = 0;
            d->entry = readdir(d->dp);
            if (!d->entry) break;
        }
        struct stat st = {.st_ino = d->entry->d_ino, .st_mode = (mode_t)d->entry->d_type << 12};
        off_t nextoff = d->entry->d_off;
        size_t len = fuse_add_direntry(req, p, rem, d->entry->d_name, &st, nextoff);
        if (len > rem) break;
        p += len; rem -= len;
        d->entry = NULL; d->offset = nextoff;
    }
    fuse_reply_buf(req, buf, size - rem);
    free(buf);
}

static void nf_releasedir(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi) {
    (void)n;
    atomic_fetch_add(&ctl->ops[OP_RELEASEDIR], 1);
    struct dir *d = (struct dir *)(uintptr_t)fi->fh;
    opened(d->fd, -1);
    closedir(d->dp);
    free(d);
    fuse_reply_err(req, 0);
}

static void nf_fsyncdir(fuse_req_t req, fuse_ino_t n, int datasync, struct fuse_file_info *fi) {
    ENTER(OP_FSYNC); STALE(n);
    int fd = dirfd(((struct dir *)(uintptr_t)fi->fh)->dp);
    int rc = datasync ? fdatasync(fd) : fsync(fd);
    fuse_reply_err(req, rc ? errno : 0);
}

static void nf_statfs(fuse_req_t req, fuse_ino_t n) {
    ENTER(OP_STATFS);
    struct statvfs sv;
    if (fstatvfs(I(n)->fd, &sv) < 0) fuse_reply_err(req, errno); else fuse_reply_statfs(req, &sv);
}

/* flock for modes "none" and "shared" (mode "local" never gets here: the kernel keeps it). */
static void nf_flock(fuse_req_t req, fuse_ino_t n, struct fuse_file_info *fi, int op) {
    (void)n;
    ENTER(OP_FLOCK);
    if (flock_mode == 1) { fuse_reply_err(req, ENOLCK); return; }
    /* Poll rather than block: a blocked worker thread would stall every other request. */
    for (;;) {
        if (flock((int)fi->fh, op | LOCK_NB) == 0) { fuse_reply_err(req, 0); return; }
        if (errno != EWOULDBLOCK || (op & LOCK_NB)) { fuse_reply_err(req, errno); return; }
        if (fuse_req_interrupted(req)) { fuse_reply_err(req, EINTR); return; }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static const struct fuse_lowlevel_ops ops = {
    .init = nf_init, .lookup = nf_lookup, .forget = nf_forget, .forget_multi = nf_forget_multi,
    .getattr = nf_getattr, .setattr = nf_setattr, .readlink = nf_readlink, .mkdir = nf_mkdir,
    .mknod = nf_mknod, .symlink = nf_symlink, .link = nf_link, .unlink = nf_unlink,
    .rmdir = nf_rmdir, .rename = nf_rename, .open = nf_open, .create = nf_create, .read = nf_read,
    .write = nf_write, .flush = nf_flush, .release = nf_release, .fsync = nf_fsync,
    .opendir = nf_opendir, .readdir = nf_readdir, .releasedir = nf_releasedir,
    .fsyncdir = nf_fsyncdir, .statfs = nf_statfs, .flock = nf_flock,
};

static void *map(const char *path, size_t size) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) { perror(path); exit(2); }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { perror("mmap"); exit(2); }
    close(fd);
    return m;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s BACKING MOUNTPOINT CONTROL BUSY local|none|shared\n", argv[0]);
        return 2;
    }
    flock_mode = !strcmp(argv[5], "none") ? 1 : !strcmp(argv[5], "shared") ? 2 : 0;
    umask(0);  /* the kernel has applied the caller's umask to every mode it sends */
    ctl = map(argv[3], sizeof(struct control));
    busy = map(argv[4], BUSY_SLOTS * sizeof(uint32_t));
    if (ctl->magic != MAGIC) { fprintf(stderr, "bad control file %s\n", argv[3]); return 2; }
    root.fd = open(argv[1], O_PATH | O_CLOEXEC);
    if (root.fd < 0) { perror(argv[1]); return 2; }
    char *fargs[] = {argv[0], "-o", "fsname=netfs,subtype=netfs,allow_other", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargs);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!se || fuse_set_signal_handlers(se) || fuse_session_mount(se, argv[2])) return 3;
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, 64);
    fuse_loop_cfg_set_idle_threads(cfg, 16);
    int rc = fuse_session_loop_mt(se, cfg);
    fuse_loop_cfg_destroy(cfg);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
